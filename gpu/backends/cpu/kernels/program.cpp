// A recorded kernel program's replay (program.py): its calls, in order, from one C call.
//
// program: [entry address, number of words n, word 0, ..., word n - 1] per call, flat int64. Each
// entry is a kernel's packed form (packed_call.h), which unpacks its words into its arguments.
// The kernels run their own OpenMP regions, as they do when called from Python.

#include <cstdint>

extern "C" void conveyor_replay(const int64_t* program, int64_t num_words) {
  using Entry = void (*)(const int64_t*);
  for (int64_t i = 0; i < num_words;) {
    const Entry entry = reinterpret_cast<Entry>(static_cast<intptr_t>(program[i]));
    const int64_t n = program[i + 1];
    entry(program + i + 2);
    i += 2 + n;
  }
}
