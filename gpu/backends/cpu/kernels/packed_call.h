// A kernel's C entry called with its arguments as one array of 64-bit words: how a recorded
// kernel program (program.py, program.cpp) replays calls of any signature through one
// function-pointer type, `void (*)(const int64_t*)`.
//
// CONVEYOR_PACKED(f), after f's definition, exports `f_packed(words)`, which calls f with word i
// as its parameter i: a pointer from the address, an integer as is, a float from the low 32 bits
// (program.py packs a float's bits there). The return value (a status) is dropped: a replayed call
// was made, and checked, once eagerly as it was recorded.

#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace conveyor_packed {

template <class T>
inline T from_word(int64_t word) {
  if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(static_cast<intptr_t>(word));
  } else if constexpr (std::is_same_v<T, float>) {
    const uint32_t bits = static_cast<uint32_t>(word);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    static_assert(std::is_integral_v<T>, "a packed call takes pointers, integers and floats");
    return static_cast<T>(word);
  }
}

template <class R, class... A, std::size_t... I>
inline void call(R (*f)(A...), const int64_t* words, std::index_sequence<I...>) {
  (void)f(from_word<A>(words[I])...);
}

template <class R, class... A>
inline void call(R (*f)(A...), const int64_t* words) {
  call(f, words, std::index_sequence_for<A...>{});
}

}  // namespace conveyor_packed

#define CONVEYOR_PACKED(name) \
  extern "C" void name##_packed(const int64_t* words) { conveyor_packed::call(name, words); }
