#include "obs/metrics_endpoint.h"

#include <cerrno>
#include <cstring>
#include <thread>

#include "base/error.h"
#include "base/host_port.h"
#include "base/http_server.h"
#include "obs/prometheus.h"

namespace pollen::obs {

struct MetricsEndpoint::Impl {
  httplib::Server server;
  std::thread thread;
  int port = 0;
};

MetricsEndpoint::MetricsEndpoint(const std::string& address, std::function<std::string()> render)
    : impl_(std::make_unique<Impl>()) {
  const std::optional<HostPort> hp = parse_host_port(address);
  POLLEN_CHECK(hp, "metrics address '", address,
               "': expected host:port with a port in [0, 65535] (an IPv6 host in brackets)");
  const std::string& host = hp->host;
  const int port = hp->port;
  impl_->server.Get("/metrics",
                    [render = std::move(render)](const httplib::Request&, httplib::Response& res) {
                      try {
                        res.set_content(render(), kPrometheusContentType);
                      } catch (const std::exception& e) {
                        res.status = 500;
                        res.set_content(e.what(), "text/plain");
                      }
                    });
  listen_exclusively(impl_->server);
  errno = 0;
  if (port == 0) {
    impl_->port = impl_->server.bind_to_any_port(host);
  } else {
    impl_->port = impl_->server.bind_to_port(host, port) ? port : -1;
  }
  POLLEN_CHECK(impl_->port > 0, "metrics address '", address, "': cannot listen there",
               errno != 0 ? cat(" (", std::strerror(errno), ")") : std::string());
  impl_->thread = listen_in_background(impl_->server);
}

MetricsEndpoint::~MetricsEndpoint() {
  impl_->server.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

int MetricsEndpoint::port() const {
  return impl_->port;
}

}  // namespace pollen::obs
