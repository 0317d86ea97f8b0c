#include "tensor/tensor.h"

#include <algorithm>
#include <cstring>

#include "tensor/allocator.h"
#include "tensor/cuda_memory.h"

namespace pollen {

std::string shape_str(const Shape& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + (s.size() == 1 ? ",)" : ")");
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) {
    POLLEN_CHECK(!__builtin_mul_overflow(n, d, &n), "shape ", shape_str(s),
                 " has more elements than int64 holds");
  }
  return n;
}

Storage::Storage(size_t bytes, Device device) : bytes_(bytes), device_(device) {
  data_ = device == Device::cpu ? CpuAllocator::instance().allocate(bytes)
                                : CudaAllocator::instance().allocate(bytes);
}

Storage::~Storage() {
  if (device_ == Device::cpu) {
    CpuAllocator::instance().release(data_);
  } else {
    CudaAllocator::instance().release(data_);
  }
}

namespace {
Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    st[i] = s;
    s *= shape[i];
  }
  return st;
}

// Reads element i (in row-major order of `t`) as double; the generic slow path.
template <typename F>
void for_each_offset(const Tensor& t, F&& f) {
  const int64_t n = t.numel();
  const int64_t d = t.dim();
  Shape idx(static_cast<size_t>(d), 0);
  int64_t off = 0;
  for (int64_t i = 0; i < n; ++i) {
    f(i, off);
    for (int64_t k = d - 1; k >= 0; --k) {
      size_t ku = static_cast<size_t>(k);
      ++idx[ku];
      off += t.strides()[ku];
      if (idx[ku] < t.shape()[ku]) break;
      off -= t.strides()[ku] * idx[ku];
      idx[ku] = 0;
    }
  }
}

double load(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::f64:
      return static_cast<const double*>(base)[i];
    case DType::f32:
      return static_cast<const float*>(base)[i];
    case DType::bf16:
      return static_cast<const bf16*>(base)[i].to_float();
    case DType::f16:
      return static_cast<const f16*>(base)[i].to_float();
    case DType::i64:
      return static_cast<double>(static_cast<const int64_t*>(base)[i]);
    case DType::i32:
      return static_cast<const int32_t*>(base)[i];
    case DType::u32:
      return static_cast<const uint32_t*>(base)[i];
    case DType::u16:
      return static_cast<const uint16_t*>(base)[i];
    case DType::u8:
      return static_cast<const uint8_t*>(base)[i];
  }
  return 0;
}

void store(void* base, DType t, int64_t i, double v) {
  switch (t) {
    case DType::f64:
      static_cast<double*>(base)[i] = v;
      break;
    case DType::f32:
      static_cast<float*>(base)[i] = static_cast<float>(v);
      break;
    case DType::bf16:
      static_cast<bf16*>(base)[i] = bf16::from_float(static_cast<float>(v));
      break;
    case DType::f16:
      static_cast<f16*>(base)[i] = f16::from_float(static_cast<float>(v));
      break;
    case DType::i64:
      static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v);
      break;
    case DType::i32:
      static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v);
      break;
    case DType::u32:
      static_cast<uint32_t*>(base)[i] = static_cast<uint32_t>(v);
      break;
    case DType::u16:
      static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(v);
      break;
    case DType::u8:
      static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v);
      break;
  }
}
}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape) POLLEN_CHECK(d >= 0, "negative dimension in shape ", shape_str(shape));
  size_t bytes = 0;
  POLLEN_CHECK(
      !__builtin_mul_overflow(static_cast<size_t>(shape_numel(shape)), dtype_size(dtype), &bytes),
      "shape ", shape_str(shape), " of ", dtype_name(dtype), " has more bytes than fit");
  Tensor t;
  t.storage_ = std::make_shared<Storage>(bytes, device);
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.zero_();
  return t;
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype) {
  Tensor t = empty(shape, dtype);
  t.fill_(value);
  return t;
}

bool Tensor::is_contiguous() const {
  return strides_ == contiguous_strides(shape_);
}

void* Tensor::raw() const {
  POLLEN_CHECK(defined(), "use of an undefined tensor");
  return static_cast<char*>(storage_->data()) + offset_ * static_cast<int64_t>(dtype_size(dtype_));
}

Tensor Tensor::view(const Shape& shape) const {
  POLLEN_CHECK(is_contiguous(), "view ", shape_str(shape), " of a non-contiguous tensor ",
               shape_str(shape_));
  Shape s = shape;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      POLLEN_CHECK(infer < 0, "view ", shape_str(shape), ": only one dimension may be -1");
      infer = static_cast<int64_t>(i);
    } else {
      known *= s[i];
    }
  }
  if (infer >= 0) s[static_cast<size_t>(infer)] = known ? numel() / known : 0;
  POLLEN_CHECK(shape_numel(s) == numel(), "cannot view ", shape_str(shape_), " as ",
               shape_str(shape));
  Tensor t = *this;
  t.shape_ = s;
  t.strides_ = contiguous_strides(s);
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  return is_contiguous() ? view(shape) : contiguous().view(shape);
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end) const {
  if (d < 0) d += dim();
  POLLEN_CHECK(d >= 0 && d < dim(), "slice: dim ", d, " out of range for ", shape_str(shape_));
  size_t du = static_cast<size_t>(d);
  POLLEN_CHECK(0 <= start && start <= end && end <= shape_[du], "slice [", start, ", ", end,
               ") out of range for dim ", d, " of ", shape_str(shape_));
  Tensor t = *this;
  t.offset_ += start * strides_[du];
  t.shape_[du] = end - start;
  return t;
}

Tensor Tensor::transpose(int64_t a, int64_t b) const {
  if (a < 0) a += dim();
  if (b < 0) b += dim();
  Tensor t = *this;
  std::swap(t.shape_[static_cast<size_t>(a)], t.shape_[static_cast<size_t>(b)]);
  std::swap(t.strides_[static_cast<size_t>(a)], t.strides_[static_cast<size_t>(b)]);
  return t;
}

Tensor Tensor::contiguous() const {
  return is_contiguous() ? *this : clone();
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_, device());
  t.copy_(*this);
  return t;
}

Tensor Tensor::to(DType dtype) const {
  Tensor t = empty(shape_, dtype, device());
  t.copy_(*this);
  return t;
}

Tensor Tensor::to(Device device) const {
  Tensor t = empty(shape_, dtype_, device);
  t.copy_(*this);
  return t;
}

Tensor Tensor::cpu() const {
  return device() == Device::cpu ? *this : to(Device::cpu);
}

size_t Tensor::span_elements() const {
  if (numel() == 0) return 0;
  int64_t last = 0;
  for (size_t i = 0; i < shape_.size(); ++i) last += (shape_[i] - 1) * strides_[i];
  return static_cast<size_t>(last + 1);
}

Tensor Tensor::host_mirror() const {
  Tensor h = *this;
  const size_t bytes = span_elements() * dtype_size(dtype_);
  h.storage_ = std::make_shared<Storage>(bytes, Device::cpu);
  h.offset_ = 0;
  if (bytes) cuda::copy_bytes(h.raw(), Device::cpu, raw(), device(), bytes);
  return h;
}

void Tensor::write_back(const Tensor& mirror) {
  const size_t bytes = span_elements() * dtype_size(dtype_);
  if (bytes) cuda::copy_bytes(raw(), device(), mirror.raw(), Device::cpu, bytes);
}

void Tensor::zero_() {
  if (!is_contiguous()) {
    fill_(0.0);
  } else if (device() == Device::cpu) {
    std::memset(raw(), 0, nbytes());
  } else {
    cuda::zero_bytes(raw(), nbytes());
  }
}

void Tensor::fill_(double value) {
  if (device() != Device::cpu) {
    if (is_contiguous()) {
      cuda::fill(raw(), dtype_, numel(), value);
    } else {
      Tensor h = host_mirror();
      h.fill_(value);
      write_back(h);
    }
    return;
  }
  void* base = raw();
  for_each_offset(*this, [&](int64_t, int64_t off) { store(base, dtype_, off, value); });
}

void Tensor::copy_(const Tensor& src) {
  POLLEN_CHECK(src.shape_ == shape_, "copy_: shape ", shape_str(src.shape_), " into ",
               shape_str(shape_));
  const bool on_host = device() == Device::cpu && src.device() == Device::cpu;
  if (src.dtype_ == dtype_ && is_contiguous() && src.is_contiguous()) {
    if (on_host) {
      std::memmove(raw(), src.raw(), nbytes());
    } else if (shares_storage(src)) {
      // The ranges may overlap, which cudaMemcpy does not allow: stage through the host.
      const Tensor staged = src.to(Device::cpu);
      cuda::copy_bytes(raw(), device(), staged.raw(), Device::cpu, nbytes());
    } else {
      cuda::copy_bytes(raw(), device(), src.raw(), src.device(), nbytes());
    }
    return;
  }
  if (!on_host) {
    if (device() == Device::cuda && src.device() == Device::cuda && is_contiguous() &&
        src.is_contiguous() && cuda::convert(src.raw(), src.dtype_, raw(), dtype_, numel()))
      return;
    // Strided copies and the other conversions that touch a GPU go through host memory: the
    // views' spans are copied over, the elements moved on the host, and the span copied back.
    const Tensor host_src = src.device() == Device::cpu ? src : src.host_mirror();
    if (device() == Device::cpu) {
      copy_(host_src);
    } else {
      Tensor host_dst = host_mirror();
      host_dst.copy_(host_src);
      write_back(host_dst);
    }
    return;
  }
  std::vector<int64_t> dst_offsets(static_cast<size_t>(numel()));
  for_each_offset(*this,
                  [&](int64_t i, int64_t off) { dst_offsets[static_cast<size_t>(i)] = off; });
  const void* sb = src.raw();
  void* db = raw();
  for_each_offset(src, [&](int64_t i, int64_t off) {
    store(db, dtype_, dst_offsets[static_cast<size_t>(i)], load(sb, src.dtype_, off));
  });
}

double Tensor::item() const {
  POLLEN_CHECK(numel() == 1, "item() of a tensor with ", numel(), " elements");
  if (device() != Device::cpu) return to(Device::cpu).item();
  return load(raw(), dtype_, 0);
}

std::vector<double> Tensor::to_doubles() const {
  if (device() != Device::cpu) return to(Device::cpu).to_doubles();
  std::vector<double> out(static_cast<size_t>(numel()));
  const void* base = raw();
  for_each_offset(*this, [&](int64_t i, int64_t off) {
    out[static_cast<size_t>(i)] = load(base, dtype_, off);
  });
  return out;
}

}  // namespace pollen
