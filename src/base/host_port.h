#pragma once
// Network addresses as configs and options give them: "host:port", an IPv6 host in brackets
// ("[::1]:9100").
#include <optional>
#include <string>
#include <string_view>

namespace pollen {

struct HostPort {
  std::string host;  // without brackets
  int port = 0;
};

// The host and port of "host:port" (or "[v6]:port"); nullopt unless the host is not empty and the
// port is a number in [0, 65535].
std::optional<HostPort> parse_host_port(std::string_view address);

// "host:port" for a URL: an IPv6 host in brackets.
std::string url_host_port(const std::string& host, int port);

}  // namespace pollen
