// CRC-32 of the native ring and spool writer (csrc/dmi/crc32.h): checks it against zlib for every
// length up to 600 bytes at several misalignments plus random lengths up to 4 MiB, then times the
// carry-less-multiplication path and the table path on 64 MiB. Build and run (needs zlib headers):
//   g++ -O3 -std=c++17 -Icsrc/dmi benchmarks/crc32_speed.cpp -lz -o /tmp/crc32_speed && /tmp/crc32_speed
#include <zlib.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "crc32.h"

template <typename F>
static double gb_per_s(F fn, size_t n) {
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return n / best / 1e9;
}

int main() {
  std::mt19937_64 rng(7);
  std::vector<uint8_t> buf((64u << 20) + 64);
  for (auto& b : buf) b = static_cast<uint8_t>(rng());
  int bad = 0, checked = 0;
  for (size_t n = 0; n < 600; ++n)
    for (size_t off = 0; off < 17; off += 3, ++checked)
      bad += ::crc32(0L, buf.data() + off, n) != dmi::crc32(buf.data() + off, n);
  for (int t = 0; t < 200; ++t, ++checked) {
    size_t n = rng() % (4u << 20), off = rng() % 64;
    bad += ::crc32(0L, buf.data() + off, n) != dmi::crc32(buf.data() + off, n);
  }
  const size_t n = 64u << 20;
  volatile uint32_t sink = 0;
  double fast = gb_per_s([&] { sink = dmi::crc32(buf.data(), n); }, n);
  double tables = gb_per_s([&] { sink = ~dmi::crc32_update_tables(0xFFFFFFFFu, buf.data(), n); }, n);
  double zlib = gb_per_s([&] { sink = ::crc32(0L, buf.data(), n); }, n);
  std::printf("{\"mismatches_vs_zlib\": %d, \"checked\": %d, \"clmul_available\": %s, \"crc32_gb_s\": %.2f, "
              "\"tables_gb_s\": %.2f, \"zlib_gb_s\": %.2f}\n",
              bad, checked,
#if defined(__x86_64__)
              dmi::crc32_has_clmul() ? "true" : "false",
#else
              "false",
#endif
              fast, tables, zlib);
  return bad != 0;
}
