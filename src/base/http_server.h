#pragma once
// cpp-httplib gives its listening sockets SO_REUSEPORT, which lets a second server bind a port a
// live one holds and take a share of its connections. pollen's HTTP servers (serve, /metrics)
// keep SO_REUSEADDR alone: a restarted server rebinds its port at once, and a second one on a busy
// port fails to start. Only for files compiled with cpp-httplib's flags (CMakeLists.txt).
#include <httplib.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

namespace pollen {

inline void listen_exclusively(httplib::Server& server) {
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
}

// Runs server.listen_after_bind() (after a successful bind) on a new thread and returns once it
// listens (or has returned): cpp-httplib's stop() does nothing before then, so a server stopped
// right after it started would listen on and its thread never end.
inline std::thread listen_in_background(httplib::Server& server) {
  auto returned = std::make_shared<std::atomic<bool>>(false);
  std::thread t([&server, returned] {
    server.listen_after_bind();
    *returned = true;
  });
  while (!server.is_running() && !*returned)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return t;
}

}  // namespace pollen
