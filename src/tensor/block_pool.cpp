#include "tensor/block_pool.h"

#include <algorithm>
#include <vector>

#include "base/error.h"

namespace pollen {

BlockPool::~BlockPool() {
  release_free_segments();
  // Blocks still in use are their owner's error, and their segments stay with the source; the
  // pool's records of them and of the free blocks beside them go with the pool.
  for (const auto& [ptr, block] : in_use_) delete block;
  for (FreeSet* free : {&free_small_, &free_large_})
    for (Block* b : *free) delete b;
}

size_t BlockPool::rounded(size_t bytes) {
  bytes = std::max<size_t>(bytes, 1);
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

void* BlockPool::allocate(size_t bytes, size_t* size) {
  const size_t want = rounded(bytes);
  const bool small = want <= kSmallRequest;
  FreeSet& free = free_set(small);
  Block key;
  key.size = want;  // and ptr nullptr: the first block of this size or more, lowest address
  Block* block = nullptr;
  if (auto it = free.lower_bound(&key); it != free.end()) {
    block = *it;
    free.erase(it);
  } else {
    block = new_segment(want, small);
    if (!block) return nullptr;
  }
  split(block, want);
  block->free = false;
  in_use_.emplace(block->ptr, block);
  in_use_bytes_ += block->size;
  *size = block->size;
  return block->ptr;
}

size_t BlockPool::release(void* ptr) {
  const auto it = in_use_.find(ptr);
  POLLEN_ASSERT(it != in_use_.end());
  Block* block = it->second;
  in_use_.erase(it);
  const size_t size = block->size;
  in_use_bytes_ -= size;
  block->free = true;
  block = merge_with_free_neighbours(block);
  free_set(block->small).insert(block);
  return size;
}

size_t BlockPool::release_free_segments() {
  size_t returned = 0;
  for (FreeSet* free : {&free_small_, &free_large_}) {
    std::vector<Block*> whole;  // free blocks that span their segment
    for (Block* b : *free)
      if (!b->prev && !b->next) whole.push_back(b);
    for (Block* b : whole) {
      free->erase(b);
      source_.release(b->ptr, b->size);
      reserved_bytes_ -= b->size;
      returned += b->size;
      delete b;
    }
  }
  return returned;
}

BlockPool::Block* BlockPool::new_segment(size_t request, bool small) {
  size_t size = kSmallSegment;
  if (!small) {
    size = request <= kMediumRequest
               ? kMediumSegment
               : (request + kLargeRounding - 1) / kLargeRounding * kLargeRounding;
  }
  void* ptr = source_.allocate(size);
  if (!ptr) return nullptr;
  reserved_bytes_ += size;
  ++segments_allocated_;
  auto* block = new Block;
  block->ptr = static_cast<char*>(ptr);
  block->size = size;
  block->small = small;
  return block;
}

// Cuts `size` bytes off the front of a free block taken out of its set; the rest, when worth
// keeping (any of the small pool's, more than a small request of a large segment), becomes a free
// block of its own. Free blocks are never adjacent, so the rest's next is in use.
void BlockPool::split(Block* block, size_t size) {
  const size_t rest_size = block->size - size;
  if (block->small ? rest_size < kAlignment : rest_size <= kSmallRequest) return;
  auto* rest = new Block;
  rest->ptr = block->ptr + size;
  rest->size = rest_size;
  rest->small = block->small;
  rest->prev = block;
  rest->next = block->next;
  if (block->next) block->next->prev = rest;
  block->next = rest;
  block->size = size;
  free_set(rest->small).insert(rest);
}

// A block just freed (in no set yet) absorbs its free neighbours, which leave their set first:
// the set orders by size.
BlockPool::Block* BlockPool::merge_with_free_neighbours(Block* block) {
  if (Block* prev = block->prev; prev && prev->free) {
    free_set(prev->small).erase(prev);
    prev->size += block->size;
    prev->next = block->next;
    if (block->next) block->next->prev = prev;
    delete block;
    block = prev;
  }
  if (Block* next = block->next; next && next->free) {
    free_set(next->small).erase(next);
    block->size += next->size;
    block->next = next->next;
    if (next->next) next->next->prev = block;
    delete next;
  }
  return block;
}

}  // namespace pollen
