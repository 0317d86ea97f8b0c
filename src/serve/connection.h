#pragma once
// Whether the client of a request is still connected. cpp-httplib gives a handler no socket, and
// the versions Debian and Ubuntu ship cannot say whether the client left; a request that waits
// for its generation would otherwise generate to the end for a client that is gone. The
// connection's socket is the one of this process whose peer is the request's address and port
// and whose local port is the request's; a client that closed its end (or reset the connection)
// leaves it readable with POLLRDHUP.
#include <string>

namespace pollen::serve {

class ClientConnection {
 public:
  // Finds the socket (the server keeps it open while the request's handler runs). Addresses as
  // getnameinfo writes them numerically, as cpp-httplib fills its requests; when no socket
  // matches, gone() cannot tell and stays false.
  ClientConnection(const std::string& remote_addr, int remote_port, int local_port);

  // True once the client has closed or reset the connection. A client that only shut down its
  // sending half (no HTTP client does while it waits for an answer) counts as gone too.
  bool gone() const;

 private:
  int fd_ = -1;
};

// Shuts down both ways every connected socket of this process whose local port is `local_port`:
// when a server stops, the clients still sending a request (a slow or trickling body) or holding
// an idle kept-alive connection, which would otherwise keep its threads reading for as long as
// bytes keep coming.
void shut_down_connections(int local_port);

}  // namespace pollen::serve
