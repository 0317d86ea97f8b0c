#pragma once
// The server's certificate revocation list (tls.crl, the CA-signed crl.pem of `pollen fed certs
// --revoke`): the serials it revokes, read again whenever the file changes (its modification
// time, size or inode: `--revoke` writes a new file and renames it into place), so that a
// revocation takes effect on a running server at the client's next call. A changed file that
// does not read, or is not signed by the CA, is logged and the last good list kept: a revoked
// certificate never becomes valid again by a damaged file.
#include <openssl/x509.h>

#include <mutex>
#include <set>
#include <string>

namespace pollen::fed {

// A certificate's serial number as upper-case hex (OpenSSL's BN_bn2hex).
std::string certificate_serial(const X509* cert);

class RevocationList {
 public:
  // Reads `crl_path` and checks its signature against the CA (`ca_pem`); throws naming the file
  // when it does not read or verify.
  RevocationList(std::string crl_path, std::string ca_pem);

  // Whether the serial is revoked by the list as it is on disk now (or the last good one).
  bool revoked(const std::string& serial);

 private:
  struct Stamp {
    long long mtime_ns = 0, size = -1;
    unsigned long long inode = 0;
    bool operator==(const Stamp&) const = default;
  };
  Stamp stamp() const;
  std::set<std::string> read() const;

  std::string path_, ca_pem_;
  std::mutex mu_;
  Stamp read_stamp_;  // of the file last read, good or not
  std::set<std::string> serials_;
};

}  // namespace pollen::fed
