#include "fed/revocation.h"

#include <openssl/pem.h>
#include <sys/stat.h>

#include <filesystem>

#include "base/error.h"
#include "base/files.h"
#include "base/log.h"

namespace pollen::fed {

namespace {

std::string serial_hex(const ASN1_INTEGER* s) {
  BIGNUM* bn = ASN1_INTEGER_to_BN(s, nullptr);
  char* hex = BN_bn2hex(bn);
  std::string out(hex);
  OPENSSL_free(hex);
  BN_free(bn);
  return out;
}

}  // namespace

std::string certificate_serial(const X509* cert) {
  return serial_hex(X509_get0_serialNumber(cert));
}

RevocationList::RevocationList(std::string crl_path, std::string ca_pem)
    : path_(std::move(crl_path)), ca_pem_(std::move(ca_pem)) {
  read_stamp_ = stamp();
  serials_ = read();
}

RevocationList::Stamp RevocationList::stamp() const {
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0) return {};
  return {static_cast<long long>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec,
          static_cast<long long>(st.st_size), static_cast<unsigned long long>(st.st_ino)};
}

std::set<std::string> RevocationList::read() const {
  POLLEN_CHECK(std::filesystem::exists(path_), "tls.crl: no file '", path_, "'");
  const std::string crl_pem = read_file(path_);
  BIO* b = BIO_new_mem_buf(crl_pem.data(), static_cast<int>(crl_pem.size()));
  X509_CRL* crl = PEM_read_bio_X509_CRL(b, nullptr, nullptr, nullptr);
  BIO_free(b);
  POLLEN_CHECK(crl, "tls.crl: '", path_, "' is not a PEM certificate revocation list");
  BIO* cb = BIO_new_mem_buf(ca_pem_.data(), static_cast<int>(ca_pem_.size()));
  X509* ca = PEM_read_bio_X509(cb, nullptr, nullptr, nullptr);
  BIO_free(cb);
  const bool ok = ca && X509_CRL_verify(crl, X509_get0_pubkey(ca)) == 1;
  if (ca) X509_free(ca);
  if (!ok) {
    X509_CRL_free(crl);
    fail("tls.crl: '", path_, "' is not signed by the CA");
  }
  std::set<std::string> out;
  STACK_OF(X509_REVOKED)* revoked = X509_CRL_get_REVOKED(crl);
  for (int i = 0; revoked && i < sk_X509_REVOKED_num(revoked); ++i)
    out.insert(serial_hex(X509_REVOKED_get0_serialNumber(sk_X509_REVOKED_value(revoked, i))));
  X509_CRL_free(crl);
  return out;
}

bool RevocationList::revoked(const std::string& serial) {
  std::lock_guard lock(mu_);
  const Stamp now = stamp();
  if (!(now == read_stamp_)) {
    read_stamp_ = now;
    try {
      std::set<std::string> fresh = read();
      log::info("fed server: tls.crl '", path_, "' changed; it now revokes ", fresh.size(),
                " certificate(s)");
      serials_ = std::move(fresh);
    } catch (const Error& e) {
      log::warn("fed server: ", e.what(), "; keeping the list read before (", serials_.size(),
                " revoked)");
    }
  }
  return serials_.count(serial) > 0;
}

}  // namespace pollen::fed
