#include "fed/tls_probe.h"

#include <fcntl.h>
#include <netdb.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <string>

#include "base/error.h"
#include "base/host_port.h"
#include "fed/openssl_owner.h"

namespace pollen::fed {

namespace {

struct Socket {
  int fd = -1;
  ~Socket() {
    if (fd >= 0) ::close(fd);
  }
};

// A write to a peer that has gone raises SIGPIPE, which would end the process: held back on this
// thread while the probe talks, and any it raised taken back.
struct SigpipeHeldBack {
  sigset_t pipe{}, before{};
  SigpipeHeldBack() {
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe, &before);
  }
  ~SigpipeHeldBack() {
    const timespec now{0, 0};
    while (sigtimedwait(&pipe, nullptr, &now) > 0) {
    }
    pthread_sigmask(SIG_SETMASK, &before, nullptr);
  }
};

using Context = OpenSSLOwned<SSL_CTX, SSL_CTX_free>;
using Session = OpenSSLOwned<SSL, SSL_free>;

std::string openssl_error() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "no detail";
  char text[256];
  ERR_error_string_n(e, text, sizeof text);
  return text;
}

// A TCP connection to host:port within `timeout_s`, its reads and writes then blocking for at
// most that long; on failure `why` says what happened.
bool connect_to(const HostPort& hp, double timeout_s, Socket& s, std::string& why) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc =
          ::getaddrinfo(hp.host.c_str(), std::to_string(hp.port).c_str(), &hints, &found);
      rc != 0) {
    why = cat("its host does not resolve (", gai_strerror(rc), ")");
    return false;
  }
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> list(found, ::freeaddrinfo);
  const int wait_ms = static_cast<int>(timeout_s * 1000);
  why = "no address of its host takes connections";
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    Socket attempt;
    attempt.fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK, a->ai_protocol);
    if (attempt.fd < 0) continue;
    if (::connect(attempt.fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      why = cat("nothing takes connections there (", std::strerror(errno), ")");
      continue;
    }
    pollfd p{attempt.fd, POLLOUT, 0};
    int error = 0;
    socklen_t size = sizeof error;
    if (::poll(&p, 1, wait_ms) != 1 ||
        ::getsockopt(attempt.fd, SOL_SOCKET, SO_ERROR, &error, &size) != 0 || error != 0) {
      why = error != 0 ? cat("nothing takes connections there (", std::strerror(error), ")")
                       : cat("no answer to a connection within ", timeout_s, " s");
      continue;
    }
    // Blocking from here, each read and write bounded by the timeout.
    ::fcntl(attempt.fd, F_SETFL, ::fcntl(attempt.fd, F_GETFL) & ~O_NONBLOCK);
    const auto whole = static_cast<time_t>(timeout_s);
    const timeval tv{whole,
                     static_cast<suseconds_t>((timeout_s - static_cast<double>(whole)) * 1e6)};
    ::setsockopt(attempt.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(attempt.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    std::swap(s.fd, attempt.fd);
    return true;
  }
  return false;
}

}  // namespace

std::string tls_handshake_problem(const std::string& address, const TlsFiles& tls,
                                  double timeout_s) {
  // gRPC's other address forms (dns:///, ipv4:, unix:) are left to gRPC's own message.
  const std::optional<HostPort> hp = parse_host_port(address);
  if (!hp) return "";
  const SigpipeHeldBack held_back;
  Socket s;
  std::string why;
  if (!connect_to(*hp, timeout_s, s, why)) return cat(address, ": ", why);

  const Context ctx(SSL_CTX_new(TLS_client_method()));
  if (!ctx || SSL_CTX_load_verify_locations(ctx.get(), tls.ca.c_str(), nullptr) != 1 ||
      SSL_CTX_use_certificate_chain_file(ctx.get(), tls.cert.c_str()) != 1 ||
      SSL_CTX_use_PrivateKey_file(ctx.get(), tls.key.c_str(), SSL_FILETYPE_PEM) != 1)
    return cat("this client's TLS files cannot be loaded for a handshake (", openssl_error(), ")");
  SSL_CTX_set_verify(ctx.get(), SSL_VERIFY_PEER, nullptr);
  const Session ssl(SSL_new(ctx.get()));
  const std::string name = tls.server_name.empty() ? hp->host : tls.server_name;
  if (!ssl || SSL_set_fd(ssl.get(), s.fd) != 1 || SSL_set1_host(ssl.get(), name.c_str()) != 1)
    return cat("OpenSSL cannot set up a handshake (", openssl_error(), ")");
  SSL_set_tlsext_host_name(ssl.get(), name.c_str());
  const unsigned char h2[] = {2, 'h', '2'};  // as gRPC offers it
  SSL_set_alpn_protos(ssl.get(), h2, sizeof h2);

  const auto refused = [&] {
    return cat("the server at ", address, " refused this client's certificate tls.cert '", tls.cert,
               "' (", openssl_error(),
               "): it trusts another CA, or the certificate was revoked (its log names it)");
  };
  if (SSL_connect(ssl.get()) != 1) {
    const long verified = SSL_get_verify_result(ssl.get());
    if (verified == X509_V_ERR_HOSTNAME_MISMATCH || verified == X509_V_ERR_IP_ADDRESS_MISMATCH)
      return cat("the server's certificate at ", address, " does not name '", name, "' (",
                 tls.server_name.empty()
                     ? "the address's host; set tls.server_name to a name it has"
                     : "tls.server_name",
                 ")");
    if (verified != X509_V_OK)
      return cat("the server's certificate at ", address, " does not verify against tls.ca '",
                 tls.ca, "' (", X509_verify_cert_error_string(verified), ")");
    // Under TLS 1.2 the server's refusal of this client's certificate is an alert here.
    const unsigned long error = ERR_peek_last_error();
    if (ERR_GET_LIB(error) == ERR_LIB_SSL && ERR_GET_REASON(error) >= SSL_AD_REASON_OFFSET)
      return refused();
    return cat("the TLS handshake with ", address, " failed (", openssl_error(),
               "): is it a TLS server?");
  }
  // Under TLS 1.3 the server judges the client's certificate after the client's side of the
  // handshake is done: its refusal arrives as an alert, or the connection's end, on the first
  // read.
  const timeval briefly{2, 0};  // an alert comes at once; an accepted client hears nothing
  ::setsockopt(s.fd, SOL_SOCKET, SO_RCVTIMEO, &briefly, sizeof briefly);
  char byte;
  const int n = SSL_read(ssl.get(), &byte, 1);
  if (n <= 0 && SSL_get_error(ssl.get(), n) == SSL_ERROR_SSL) return refused();
  return "";
}

}  // namespace pollen::fed
