// `pollen fed certs`: a development CA, the server's certificate and one per client, made with
// OpenSSL (EC P-256 keys, SHA-256 signatures), and a CA-signed revocation list.
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <arpa/inet.h>

#include <algorithm>
#include <filesystem>

#include "base/error.h"
#include "base/files.h"
#include "base/log.h"
#include "fed/grpc.h"
#include "fed/wire.h"

namespace pollen::fed {

namespace fs = std::filesystem;

namespace {

[[noreturn]] void ssl_fail(const std::string& what) {
  fail("fed certs: OpenSSL failed to ", what);
}

EVP_PKEY* new_key() {
  EVP_PKEY* k = EVP_EC_gen("P-256");
  if (!k) ssl_fail("generate a P-256 key");
  return k;
}

std::string key_pem(EVP_PKEY* k) {
  BIO* b = BIO_new(BIO_s_mem());
  PEM_write_bio_PrivateKey(b, k, nullptr, nullptr, 0, nullptr, nullptr);
  char* data;
  const long n = BIO_get_mem_data(b, &data);
  std::string out(data, static_cast<size_t>(n));
  BIO_free(b);
  return out;
}

std::string cert_pem(X509* c) {
  BIO* b = BIO_new(BIO_s_mem());
  PEM_write_bio_X509(b, c);
  char* data;
  const long n = BIO_get_mem_data(b, &data);
  std::string out(data, static_cast<size_t>(n));
  BIO_free(b);
  return out;
}

X509* read_cert(const fs::path& p) {
  const std::string s = read_file(p);
  BIO* b = BIO_new_mem_buf(s.data(), static_cast<int>(s.size()));
  X509* c = PEM_read_bio_X509(b, nullptr, nullptr, nullptr);
  BIO_free(b);
  POLLEN_CHECK(c, "fed certs: '", p.string(), "' is not a PEM certificate");
  return c;
}

EVP_PKEY* read_key(const fs::path& p) {
  const std::string s = read_file(p);
  BIO* b = BIO_new_mem_buf(s.data(), static_cast<int>(s.size()));
  EVP_PKEY* k = PEM_read_bio_PrivateKey(b, nullptr, nullptr, nullptr);
  BIO_free(b);
  POLLEN_CHECK(k, "fed certs: '", p.string(), "' is not a PEM private key");
  return k;
}

void add_ext(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  if (!ext) ssl_fail(cat("make extension ", value));
  X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
}

// A certificate for `key` named `cn`, signed by (issuer, issuer_key); self-signed when issuer is
// null.
X509* make_cert(EVP_PKEY* key, const std::string& cn, X509* issuer, EVP_PKEY* issuer_key, int days,
                const std::vector<std::pair<int, std::string>>& exts) {
  X509* c = X509_new();
  X509_set_version(c, 2);
  unsigned char serial[16];
  RAND_bytes(serial, sizeof serial);
  serial[0] &= 0x7f;  // positive
  BIGNUM* bn = BN_bin2bn(serial, sizeof serial, nullptr);
  BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(c));
  BN_free(bn);
  X509_gmtime_adj(X509_getm_notBefore(c), -60);
  X509_gmtime_adj(X509_getm_notAfter(c), static_cast<long>(days) * 86400);
  X509_set_pubkey(c, key);
  X509_NAME* name = X509_get_subject_name(c);
  if (!X509_NAME_add_entry_by_txt(name, "O", MBSTRING_ASC,
                                  reinterpret_cast<const unsigned char*>("pollen federation"), -1,
                                  -1, 0) ||
      !X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                                  reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1, 0))
    ssl_fail(cat("name a certificate '", cn, "'"));
  X509_set_issuer_name(c, issuer ? X509_get_subject_name(issuer) : name);
  for (const auto& [nid, v] : exts) add_ext(c, issuer ? issuer : c, nid, v);
  if (!X509_sign(c, issuer_key, EVP_sha256())) ssl_fail("sign a certificate");
  return c;
}

void write_private(const fs::path& p, const std::string& pem) {
  write_file_atomic(p, pem, 0600);  // never readable by others, not even before the rename
}

bool is_ip(const std::string& s) {
  unsigned char buf[16];
  return inet_pton(AF_INET, s.c_str(), buf) == 1 || inet_pton(AF_INET6, s.c_str(), buf) == 1;
}

}  // namespace

void make_dev_certs(const fs::path& dir, const std::vector<std::string>& clients,
                    const std::vector<std::string>& server_names, int days, bool replace_server,
                    bool replace_clients) {
  // The CA lives ten times as long; X.509 times end in 9999.
  POLLEN_CHECK(days >= 1 && days <= 36500,
               "fed certs: --days must be 1 to 36500 (a century; the CA is made for ten times "
               "as long), got ",
               days);
  POLLEN_CHECK(!server_names.empty(), "fed certs: at least one server name is needed");
  for (size_t i = 0; i < clients.size(); ++i) {
    const std::string& id = clients[i];
    check_client_id(id, "fed certs --client");
    POLLEN_CHECK(std::find(clients.begin(), clients.begin() + static_cast<std::ptrdiff_t>(i), id) ==
                     clients.begin() + static_cast<std::ptrdiff_t>(i),
                 "fed certs --client: '", id, "' is given twice");
    POLLEN_CHECK(id.size() <= 64, "fed certs --client: '", id,
                 "' is longer than the 64 characters a certificate's common name holds");
    POLLEN_CHECK(replace_clients || !fs::exists(dir / cat("client-", id, ".pem")),
                 "fed certs --client: '", id, "' has a certificate already in ",
                 (dir / cat("client-", id, ".pem")).string(),
                 "; a new one would leave the old one valid: pass --replace to revoke it and "
                 "make another");
  }
  fs::create_directories(dir);
  EVP_PKEY* ca_key;
  X509* ca;
  const bool has_ca_cert = fs::exists(dir / "ca.pem"), has_ca_key = fs::exists(dir / "ca.key");
  // A new CA beside one half of the old, or beside certificates the old one signed, would
  // leave every certificate issued so far unverifiable (and overwrite the half that is there).
  POLLEN_CHECK(has_ca_cert == has_ca_key,
               "fed certs: ", (dir / (has_ca_cert ? "ca.pem" : "ca.key")).string(),
               " is there but ", (dir / (has_ca_cert ? "ca.key" : "ca.pem")).string(),
               " is not: the CA needs both to sign (put the missing file back; a new CA would "
               "invalidate every certificate it signed)");
  if (!has_ca_cert) {
    for (const auto& entry : fs::directory_iterator(dir)) {
      const std::string name = entry.path().filename().string();
      POLLEN_CHECK(
          !(name == "server.pem" || (name.starts_with("client-") && name.ends_with(".pem"))),
          "fed certs: ", dir.string(), " holds ", name,
          " but no CA (ca.pem, ca.key): a new CA would not verify it; put the CA's "
          "files back, or make the certificates in a new folder");
    }
  }
  if (has_ca_cert) {
    ca = read_cert(dir / "ca.pem");
    ca_key = read_key(dir / "ca.key");
    if (X509_check_private_key(ca, ca_key) != 1) {
      X509_free(ca);
      EVP_PKEY_free(ca_key);
      fail("fed certs: ", (dir / "ca.key").string(), " is not the key of ",
           (dir / "ca.pem").string());
    }
    log::info("fed certs: using the CA in ", (dir / "ca.pem").string());
  } else {
    ca_key = new_key();
    ca = make_cert(ca_key, "pollen development CA", nullptr, ca_key, days * 10,
                   {{NID_basic_constraints, "critical,CA:TRUE"},
                    {NID_key_usage, "critical,keyCertSign,cRLSign"},
                    {NID_subject_key_identifier, "hash"}});
    write_private(dir / "ca.key", key_pem(ca_key));
    write_file_atomic(dir / "ca.pem", cert_pem(ca));
  }
  std::string san;
  for (const auto& n : server_names)
    san += cat(san.empty() ? "" : ",", is_ip(n) ? "IP:" : "DNS:", n);
  const bool keep_server =
      !replace_server && fs::exists(dir / "server.pem") && fs::exists(dir / "server.key");
  if (keep_server) {
    log::info("fed certs: keeping the server certificate in ", (dir / "server.pem").string(),
              " (pass --server-name to make another)");
  } else {
    EVP_PKEY* k = new_key();
    X509* c = make_cert(k, server_names[0], ca, ca_key, days,
                        {{NID_basic_constraints, "critical,CA:FALSE"},
                         {NID_key_usage, "critical,digitalSignature"},
                         {NID_ext_key_usage, "serverAuth"},
                         {NID_subject_alt_name, san}});
    write_private(dir / "server.key", key_pem(k));
    write_file_atomic(dir / "server.pem", cert_pem(c));
    X509_free(c);
    EVP_PKEY_free(k);
  }
  for (const auto& id : clients) {
    if (fs::exists(dir / cat("client-", id, ".pem"))) revoke_client_cert(dir, id);  // --replace
    EVP_PKEY* k = new_key();
    X509* c = make_cert(k, id, ca, ca_key, days,
                        {{NID_basic_constraints, "critical,CA:FALSE"},
                         {NID_key_usage, "critical,digitalSignature"},
                         {NID_ext_key_usage, "clientAuth"}});
    write_private(dir / cat("client-", id, ".key"), key_pem(k));
    write_file_atomic(dir / cat("client-", id, ".pem"), cert_pem(c));
    X509_free(c);
    EVP_PKEY_free(k);
  }
  X509_free(ca);
  EVP_PKEY_free(ca_key);
  log::info("fed certs: wrote ", keep_server ? "" : "the server's and ", clients.size(),
            " client certificates to ", dir.string());
}

void revoke_client_cert(const fs::path& dir, const std::string& client) {
  check_client_id(client, "fed certs revoke");
  X509* ca = read_cert(dir / "ca.pem");
  EVP_PKEY* ca_key = read_key(dir / "ca.key");
  X509* victim = read_cert(dir / cat("client-", client, ".pem"));
  X509_CRL* crl = nullptr;
  if (fs::exists(dir / "crl.pem")) {
    const std::string s = read_file(dir / "crl.pem");
    BIO* b = BIO_new_mem_buf(s.data(), static_cast<int>(s.size()));
    crl = PEM_read_bio_X509_CRL(b, nullptr, nullptr, nullptr);
    BIO_free(b);
    POLLEN_CHECK(crl, "fed certs: '", (dir / "crl.pem").string(), "' is not a PEM CRL");
  } else {
    crl = X509_CRL_new();
    X509_CRL_set_version(crl, 1);
    X509_CRL_set_issuer_name(crl, X509_get_subject_name(ca));
  }
  X509_REVOKED* listed = nullptr;
  if (X509_CRL_get0_by_serial(crl, &listed, X509_get_serialNumber(victim)) == 1) {
    log::info("fed certs: client '", client, "' (", (dir / cat("client-", client, ".pem")).string(),
              ") is revoked already");
    X509_CRL_free(crl);
    X509_free(victim);
    EVP_PKEY_free(ca_key);
    X509_free(ca);
    return;
  }
  X509_REVOKED* r = X509_REVOKED_new();
  X509_REVOKED_set_serialNumber(r, X509_get_serialNumber(victim));
  ASN1_TIME* now = X509_gmtime_adj(nullptr, 0);
  X509_REVOKED_set_revocationDate(r, now);
  X509_CRL_add0_revoked(crl, r);
  X509_CRL_set1_lastUpdate(crl, now);
  ASN1_TIME* next = X509_gmtime_adj(nullptr, 30L * 86400);
  X509_CRL_set1_nextUpdate(crl, next);
  ASN1_TIME_free(now);
  ASN1_TIME_free(next);
  X509_CRL_sort(crl);
  if (!X509_CRL_sign(crl, ca_key, EVP_sha256())) ssl_fail("sign the CRL");
  BIO* b = BIO_new(BIO_s_mem());
  PEM_write_bio_X509_CRL(b, crl);
  char* data;
  const long n = BIO_get_mem_data(b, &data);
  write_file_atomic(dir / "crl.pem", std::string(data, static_cast<size_t>(n)));
  BIO_free(b);
  X509_CRL_free(crl);
  X509_free(victim);
  X509_free(ca);
  EVP_PKEY_free(ca_key);
  log::info("fed certs: revoked client '", client, "' in ", (dir / "crl.pem").string());
}

}  // namespace pollen::fed
