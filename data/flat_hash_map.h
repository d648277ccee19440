#pragma once
// A hash map for the BPE model's large, built-once tables: the vocabulary (token -> id,
// 262k entries for Gemma) and the merges ((left id, right id) -> rank, 515k). The entries sit
// in one array in insertion order and a power-of-two array of 8-byte slots (entry index + 32
// bits of the hash) is probed linearly: a lookup touches one slot and one entry, where
// std::unordered_map walks a bucket pointer to a node allocated on its own. Building these
// two tables through std::unordered_map was most of the time to load a Llama 3
// tokenizer.json. No erase: the tables never shrink.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace qtrain::data {

// Hash is called with Key and with any LookupKey passed to find (std::hash<std::string_view>
// serves std::string keys looked up by string_view).
template <typename Key, typename Value, typename Hash = std::hash<Key>>
class FlatHashMap {
 public:
  void reserve(size_t count) {
    entries_.reserve(count);
    if (count * 2 > slots_.size()) rehash(count * 2);
  }
  size_t size() const { return entries_.size(); }

  // The value of `key`, or nullptr.
  template <typename LookupKey>
  const Value* find(const LookupKey& key) const {
    if (slots_.empty()) return nullptr;
    const uint64_t hash = mixed_hash(key);
    for (size_t slot = hash >> shift_;; slot = (slot + 1) & mask()) {
      const uint64_t occupant = slots_[slot];
      if (occupant == kEmpty) return nullptr;
      if (tag_of(occupant) == tag_of_hash(hash)) {
        const auto& entry = entries_[index_of(occupant)];
        if (entry.first == key) return &entry.second;
      }
    }
  }

  // Starts loading the slot where `key` would be, for a find soon after: in a loop of lookups
  // into a table of megabytes, each find otherwise waits for memory in turn.
  template <typename LookupKey>
  void prefetch(const LookupKey& key) const {
    if (!slots_.empty()) __builtin_prefetch(&slots_[mixed_hash(key) >> shift_]);
  }

  // Sets the value of `key`, adding the key when it is new (a repeated key keeps its place).
  void insert_or_assign(Key key, Value value) {
    if ((entries_.size() + 1) * 2 > slots_.size()) rehash(std::max<size_t>(16, slots_.size() * 2));
    const uint64_t hash = mixed_hash(key);
    size_t slot = hash >> shift_;
    for (;; slot = (slot + 1) & mask()) {
      const uint64_t occupant = slots_[slot];
      if (occupant == kEmpty) break;
      if (tag_of(occupant) == tag_of_hash(hash) && entries_[index_of(occupant)].first == key) {
        entries_[index_of(occupant)].second = std::move(value);
        return;
      }
    }
    slots_[slot] = slot_value(hash, entries_.size());
    entries_.emplace_back(std::move(key), std::move(value));
  }

  // Every (key, value) in the order the keys were first inserted.
  const std::vector<std::pair<Key, Value>>& entries() const { return entries_; }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};

  // Fibonacci hashing: the top bits of hash * 2^64/phi pick the slot, so that hashes that
  // differ only in low bits (std::hash of an integer is the integer) still spread.
  template <typename LookupKey>
  static uint64_t mixed_hash(const LookupKey& key) {
    return static_cast<uint64_t>(Hash{}(key)) * 0x9E3779B97F4A7C15ull;
  }
  static uint64_t tag_of_hash(uint64_t hash) { return hash & 0xFFFFFFFFull; }
  static uint64_t tag_of(uint64_t occupant) { return occupant >> 32; }
  static size_t index_of(uint64_t occupant) { return static_cast<size_t>(occupant & 0xFFFFFFFFull); }
  static uint64_t slot_value(uint64_t hash, size_t index) { return (tag_of_hash(hash) << 32) | index; }
  size_t mask() const { return slots_.size() - 1; }

  void rehash(size_t minimum_slots) {
    size_t count = 16;
    int bits = 4;
    while (count < minimum_slots) {
      count *= 2;
      ++bits;
    }
    slots_.assign(count, kEmpty);
    shift_ = 64 - bits;
    for (size_t index = 0; index < entries_.size(); ++index) {
      const uint64_t hash = mixed_hash(entries_[index].first);
      size_t slot = hash >> shift_;
      while (slots_[slot] != kEmpty) slot = (slot + 1) & mask();
      slots_[slot] = slot_value(hash, index);
    }
  }

  std::vector<std::pair<Key, Value>> entries_;
  std::vector<uint64_t> slots_;
  int shift_ = 64;
};

}  // namespace qtrain::data
