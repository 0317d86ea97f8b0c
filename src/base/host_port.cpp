#include "base/host_port.h"

#include <charconv>

namespace pollen {

std::optional<HostPort> parse_host_port(std::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == address.size())
    return std::nullopt;
  HostPort hp;
  const char* end = address.data() + address.size();
  const auto r = std::from_chars(address.data() + colon + 1, end, hp.port);
  if (r.ec != std::errc() || r.ptr != end || hp.port < 0 || hp.port > 65535) return std::nullopt;
  std::string_view host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  else if (host.find(':') != std::string_view::npos)
    return std::nullopt;  // an IPv6 host without brackets: its last group reads as the port
  hp.host = std::string(host);
  return hp;
}

std::string url_host_port(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

}  // namespace pollen
