// serve/connection.h: the socket of a request found from its addresses, and a client that closed
// its end seen as gone.
#include "serve/connection.h"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace pollen::serve {
namespace {

int port_of(int fd, bool peer) {
  sockaddr_in a{};
  socklen_t len = sizeof(a);
  if (peer ? getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len)
           : getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len))
    return -1;
  return ntohs(a.sin_port);
}

TEST(ClientConnection, SeesTheClientCloseItsEnd) {
  const int listener = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(listener, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(listen(listener, 4), 0);
  address.sin_port = htons(static_cast<uint16_t>(port_of(listener, false)));
  // Two clients: the connection found must be the one named, not the other.
  const int client = socket(AF_INET, SOCK_STREAM, 0), other = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(connect(client, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  ASSERT_EQ(connect(other, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  const int served = accept(listener, nullptr, nullptr),
            served_other = accept(listener, nullptr, nullptr);
  ASSERT_GE(served, 0);
  ASSERT_GE(served_other, 0);
  const int local_port = port_of(listener, false);

  const ClientConnection connection("127.0.0.1", port_of(client, false), local_port);
  EXPECT_FALSE(connection.gone());
  close(other);  // another client leaving is not this one
  EXPECT_FALSE(connection.gone());
  ASSERT_EQ(write(client, "GET", 3), 3);  // data waiting to be read is not an end either
  EXPECT_FALSE(connection.gone());
  close(client);
  bool gone = false;  // the end arrives through the loopback device: at once, or nearly
  for (int w = 0; w < 100 && !(gone = connection.gone()); ++w) usleep(10000);
  EXPECT_TRUE(gone);
  // An address that names no socket of this process: it cannot tell, so not gone.
  EXPECT_FALSE(ClientConnection("127.0.0.1", 1, local_port).gone());
  for (int fd : {served, served_other, listener}) close(fd);
}

}  // namespace
}  // namespace pollen::serve
