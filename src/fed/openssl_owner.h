#pragma once
// OpenSSL objects held by std::unique_ptr: OpenSSLOwned<X509, X509_free> frees with X509_free.

#include <memory>

namespace pollen::fed {

template <typename T, void (*Free)(T*)>
struct OpenSSLFree {
  void operator()(T* p) const { Free(p); }
};

template <typename T, void (*Free)(T*)>
using OpenSSLOwned = std::unique_ptr<T, OpenSSLFree<T, Free>>;

}  // namespace pollen::fed
