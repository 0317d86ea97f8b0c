#pragma once
// A tensor: a view (shape, strides in elements, offset) onto reference-counted storage of one
// dtype on one device. Copies share storage; clone() copies data. Most ops take contiguous
// tensors; view() and reshape() never copy, contiguous() copies only when needed.
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "base/error.h"
#include "tensor/device.h"
#include "tensor/dtype.h"

namespace pollen {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& s);  // "(2, 3, 4)"
int64_t shape_numel(const Shape& s);

class Storage {
 public:
  Storage(size_t bytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  Device device_;
};

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false

  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu);
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu);
  static Tensor full(const Shape& shape, double value, DType dtype);
  template <typename T>
  static Tensor from(const Shape& shape, const std::vector<T>& values);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::cpu; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t d) const { return shape_.at(static_cast<size_t>(d < 0 ? d + dim() : d)); }
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;

  template <typename T>
  T* data() const {
    POLLEN_CHECK(dtype_of<T>::value == dtype_, "tensor of dtype ", dtype_name(dtype_),
                 " accessed as ", dtype_name(dtype_of<T>::value));
    return static_cast<T*>(raw());
  }
  void* raw() const;  // pointer to the first element

  // Views sharing storage.
  Tensor view(const Shape& shape) const;     // contiguous only; one dim may be -1
  Tensor reshape(const Shape& shape) const;  // view when contiguous, else a contiguous copy
  Tensor slice(int64_t dim, int64_t start, int64_t end) const;  // [start, end) along dim
  Tensor transpose(int64_t a, int64_t b) const;

  Tensor contiguous() const;
  Tensor clone() const;
  Tensor to(DType dtype) const;    // converts (copies even when the dtype is the same)
  Tensor to(Device device) const;  // a contiguous copy on `device` (copies even on the same one)
  Tensor cpu() const;              // this tensor when it is on the CPU, else a copy there

  // On the GPU these run in order on its default stream (tensor/cuda_memory.h); copies that
  // involve host memory have finished when they return.
  void zero_();
  void fill_(double value);
  void copy_(const Tensor& src);  // same shape; converts dtype; across devices

  double item() const;                     // the value of a one-element float or integer tensor
  std::vector<double> to_doubles() const;  // every element, row-major

  bool shares_storage(const Tensor& other) const { return storage_ == other.storage_; }

 private:
  // GPU views moved through host memory: the elements from the first to the last one the view
  // reaches, copied into a host tensor with the same view, and copied back.
  size_t span_elements() const;
  Tensor host_mirror() const;
  void write_back(const Tensor& mirror);

  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_, strides_;
  DType dtype_ = DType::f32;
};

template <typename T>
Tensor Tensor::from(const Shape& shape, const std::vector<T>& values) {
  POLLEN_CHECK(shape_numel(shape) == static_cast<int64_t>(values.size()), "Tensor::from: shape ",
               shape_str(shape), " needs ", shape_numel(shape), " values, got ", values.size());
  Tensor t = empty(shape, dtype_of<T>::value);
  std::copy(values.begin(), values.end(), t.data<T>());
  return t;
}

}  // namespace pollen
