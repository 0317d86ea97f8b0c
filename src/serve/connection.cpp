#include "serve/connection.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>

#include <cstdlib>
#include <filesystem>
#include <system_error>

namespace pollen::serve {

namespace {

// The numeric host and port of a socket address, as cpp-httplib writes a request's.
bool numeric_address(const sockaddr_storage& addr, socklen_t len, std::string& host, int& port) {
  char h[NI_MAXHOST], s[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, h, sizeof(h), s, sizeof(s),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return false;
  host = h;
  port = std::atoi(s);
  return true;
}

bool is_connection(int fd, const std::string& remote_addr, int remote_port, int local_port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return false;
  std::string host;
  int port = 0;
  if (!numeric_address(addr, len, host, port) || host != remote_addr || port != remote_port)
    return false;
  if (local_port <= 0) return true;
  len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return false;
  return numeric_address(addr, len, host, port) && port == local_port;
}

// Every open file descriptor of this process, from /proc/self/fd.
template <typename Fn>
void for_each_fd(Fn fn) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    char* end = nullptr;
    const std::string name = entry.path().filename().string();
    const long fd = std::strtol(name.c_str(), &end, 10);
    if (end == name.c_str() || *end != '\0') continue;
    if (fn(static_cast<int>(fd))) return;
  }
}

}  // namespace

void shut_down_connections(int local_port) {
  for_each_fd([&](int fd) {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    std::string host;
    int port = 0;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return false;
    len = sizeof(addr);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0 &&
        numeric_address(addr, len, host, port) && port == local_port)
      ::shutdown(fd, SHUT_RDWR);
    return false;
  });
}

ClientConnection::ClientConnection(const std::string& remote_addr, int remote_port,
                                   int local_port) {
  for_each_fd([&](int fd) {
    if (!is_connection(fd, remote_addr, remote_port, local_port)) return false;
    fd_ = fd;
    return true;
  });
}

bool ClientConnection::gone() const {
  if (fd_ < 0) return false;
  pollfd p{fd_, POLLRDHUP, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

}  // namespace pollen::serve
