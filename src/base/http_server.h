#pragma once
// cpp-httplib gives its listening sockets SO_REUSEPORT, which lets a second server bind a port a
// live one holds and take a share of its connections. pollen's HTTP servers (serve, /metrics)
// keep SO_REUSEADDR alone: a restarted server rebinds its port at once, and a second one on a busy
// port fails to start. Only for files compiled with cpp-httplib's flags (CMakeLists.txt).
#include <httplib.h>
#include <sys/socket.h>

namespace pollen {

inline void listen_exclusively(httplib::Server& server) {
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
}

}  // namespace pollen
