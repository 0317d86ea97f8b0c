#pragma once
// The TLS files of a server or client, checked before gRPC takes them: gRPC says of a key that
// is not the certificate's, an expired certificate or one of another CA only that a handshake
// failed (or that the port cannot be listened on), and the other side often says nothing.
#include "fed/config.h"

namespace pollen::fed {

// Refuses, naming the key (tls.ca, tls.cert, tls.key) and the file: a file that is not PEM of its
// kind (a key with a passphrase included), a key that is not the certificate's, a certificate or
// CA not valid now (expired, or not yet), a certificate whose extended key usage does not allow
// this side's role (a client's certificate given to the server, or the reverse). Warns when the
// certificate (with the intermediates after it in tls.cert) does not verify against tls.ca,
// which the other side may still trust for it. `role`: the side these files serve.
enum class TlsRole { server, client };
void check_tls_files(const TlsFiles& tls, TlsRole role);

}  // namespace pollen::fed
