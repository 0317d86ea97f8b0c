#include "fed/tls_check.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <vector>

#include "base/error.h"
#include "base/files.h"
#include "base/log.h"
#include "fed/openssl_owner.h"

namespace pollen::fed {

namespace {

using Bio = OpenSSLOwned<BIO, BIO_free_all>;
using Cert = OpenSSLOwned<X509, X509_free>;
using Key = OpenSSLOwned<EVP_PKEY, EVP_PKEY_free>;
using Store = OpenSSLOwned<X509_STORE, X509_STORE_free>;
using StoreCtx = OpenSSLOwned<X509_STORE_CTX, X509_STORE_CTX_free>;

// Frees the list, not the certificates in it (the vector of Cert owns those).
void free_stack(STACK_OF(X509) * s) {
  sk_X509_free(s);
}

std::string where(const char* who, const char* key, const std::string& path) {
  return cat(who, ": tls.", key, " '", path, "'");
}

Bio open_pem(const char* who, const char* key, const std::string& path) {
  POLLEN_CHECK(std::filesystem::exists(path), where(who, key, path), ": no such file");
  const std::string text = read_file(path);
  Bio bio(BIO_new(BIO_s_mem()));  // holds its own copy of the text
  POLLEN_CHECK(bio && BIO_write(bio.get(), text.data(), static_cast<int>(text.size())) ==
                          static_cast<int>(text.size()),
               where(who, key, path), ": cannot be read");
  return bio;
}

std::vector<Cert> read_certs(const char* who, const char* key, const std::string& path) {
  Bio bio = open_pem(who, key, path);
  std::vector<Cert> certs;
  while (X509* c = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) certs.emplace_back(c);
  ERR_clear_error();  // the end of the file reads as an error
  POLLEN_CHECK(!certs.empty(), where(who, key, path), ": expected a PEM certificate");
  return certs;
}

std::string time_text(const ASN1_TIME* t) {
  Bio bio(BIO_new(BIO_s_mem()));
  if (!bio || ASN1_TIME_print(bio.get(), t) != 1) return "?";
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

}  // namespace

void check_tls_files(const TlsFiles& tls, TlsRole role) {
  if (!tls.enabled()) return;
  const bool serving = role == TlsRole::server;
  const char* who = serving ? "fed server" : "fed client";
  const std::vector<Cert> cas = read_certs(who, "ca", tls.ca);
  const std::vector<Cert> chain = read_certs(who, "cert", tls.cert);
  X509* cert = chain.front().get();
  Bio key_bio = open_pem(who, "key", tls.key);
  // No passphrase: OpenSSL's default would ask for one at the terminal.
  const auto no_passphrase = [](char*, int, int, void*) { return 0; };
  const Key key(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, no_passphrase, nullptr));
  ERR_clear_error();
  POLLEN_CHECK(key, where(who, "key", tls.key),
               ": expected a PEM private key without a passphrase");
  POLLEN_CHECK(X509_check_private_key(cert, key.get()) == 1, where(who, "key", tls.key),
               " is not the key of tls.cert '", tls.cert, "' (another certificate's)");
  ERR_clear_error();
  POLLEN_CHECK(X509_cmp_current_time(X509_get0_notAfter(cert)) > 0, where(who, "cert", tls.cert),
               ": expired on ", time_text(X509_get0_notAfter(cert)));
  POLLEN_CHECK(X509_cmp_current_time(X509_get0_notBefore(cert)) < 0, where(who, "cert", tls.cert),
               ": not valid before ", time_text(X509_get0_notBefore(cert)));
  // A CA file whose every certificate expired fails every handshake of the side that trusts it,
  // whatever they signed (a bundle may hold retired roots beside current ones).
  const auto expired = [](const Cert& ca) {
    return X509_cmp_current_time(X509_get0_notAfter(ca.get())) <= 0;
  };
  POLLEN_CHECK(!std::all_of(cas.begin(), cas.end(), expired), where(who, "ca", tls.ca),
               cas.size() == 1 ? cat(": the CA certificate expired on ",
                                     time_text(X509_get0_notAfter(cas.front().get())))
                               : std::string(": every CA certificate in it expired"));
  POLLEN_CHECK(
      X509_check_purpose(cert, serving ? X509_PURPOSE_SSL_SERVER : X509_PURPOSE_SSL_CLIENT, 0) == 1,
      where(who, "cert", tls.cert), ": its extended key usage does not allow a TLS ",
      serving ? "server" : "client", " (a ", serving ? "client's" : "server's",
      " certificate given here?); pollen fed certs makes server.pem for the server and "
      "client-ID.pem for each client");
  ERR_clear_error();
  const Store store(X509_STORE_new());
  POLLEN_CHECK(store, who, ": OpenSSL cannot make a certificate store");
  for (const Cert& ca : cas) X509_STORE_add_cert(store.get(), ca.get());
  // The certificates after the first in tls.cert are its chain (intermediates), sent with it.
  using Chain = OpenSSLOwned<STACK_OF(X509), free_stack>;
  const Chain untrusted(sk_X509_new_null());
  POLLEN_CHECK(untrusted, who, ": OpenSSL cannot make a certificate list");
  for (size_t i = 1; i < chain.size(); ++i) sk_X509_push(untrusted.get(), chain[i].get());
  const StoreCtx ctx(X509_STORE_CTX_new());
  POLLEN_CHECK(ctx && X509_STORE_CTX_init(ctx.get(), store.get(), cert, untrusted.get()) == 1, who,
               ": OpenSSL cannot check a certificate");
  const bool verified = X509_verify_cert(ctx.get()) == 1;
  const int error = X509_STORE_CTX_get_error(ctx.get());
  ERR_clear_error();
  // tls.ca is the CA this side trusts for the other; the other side may trust another for this
  // one (a server certificate from a public CA, say), so this is a warning, not a refusal.
  if (!verified)
    log::warn(where(who, "cert", tls.cert), " does not verify against tls.ca '", tls.ca, "' (",
              X509_verify_cert_error_string(error),
              "): the other side must trust another CA for it, or it refuses the handshake (with "
              "pollen fed certs, both sides use one CA)");
}

}  // namespace pollen::fed
