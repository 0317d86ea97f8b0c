#pragma once
// Why a client cannot get through to a TLS federation server, found by shaking hands by hand:
// gRPC reports a refused handshake as an unreachable server, and says why only in its own logs
// (the client's, the server's), so a client that waited in vain tries once more with OpenSSL.
#include <string>

#include "fed/config.h"

namespace pollen::fed {

// Connects to `address` with the client's TLS files and says what stands in the way: nothing
// listening there, the server's certificate not verifying against tls.ca or not naming the host
// (tls.server_name), or the server refusing this client's certificate. Empty when the handshake
// goes through (the trouble is elsewhere) or `address` is none of host:port (gRPC's dns:///,
// ipv4:, unix: forms). Waits at most `timeout_s` for each step.
std::string tls_handshake_problem(const std::string& address, const TlsFiles& tls,
                                  double timeout_s);

}  // namespace pollen::fed
