// CRC-32 as zlib.crc32 computes it (IEEE 802.3 polynomial, reflected: 0xEDB88320; initial and final
// value all ones): carry-less multiplication where the CPU has it (x86-64), else slicing-by-8
// tables. The consumer and the spool writer checksum payloads here, without the GIL: a Python-side
// zlib.crc32 per record released and re-took the GIL once per record, and every re-take from a
// background thread stalls the training thread's launches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace dmi {

struct Crc32Tables {
  uint32_t t[8][256];
  Crc32Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
      t[0][i] = c;
    }
    for (int k = 1; k < 8; ++k)
      for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
  }
};

inline const Crc32Tables& crc32_tables() {
  static const Crc32Tables tables;
  return tables;
}

// The CRC register after n more bytes (no initial or final inversion), with the tables.
// Little-endian hosts only (x86-64, aarch64), like the rest of the payload format.
inline uint32_t crc32_update_tables(uint32_t crc, const uint8_t* p, size_t n) {
  const auto& t = crc32_tables().t;
  for (; n && (reinterpret_cast<uintptr_t>(p) & 7); --n) crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= crc;
    crc = t[7][v & 0xff] ^ t[6][(v >> 8) & 0xff] ^ t[5][(v >> 16) & 0xff] ^ t[4][(v >> 24) & 0xff] ^
          t[3][(v >> 32) & 0xff] ^ t[2][(v >> 40) & 0xff] ^ t[1][(v >> 48) & 0xff] ^ t[0][v >> 56];
  }
  for (; n; --n) crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
// The same register update with carry-less multiplication (PCLMULQDQ), several times faster than
// the tables: four 16-byte lanes are folded forward 64 bytes at a time (each lane times x^(512+-32)
// mod P, the constants below in the reflected form with the usual one-bit shift), then into one
// lane, which then folds 16 bytes at a time. Folding keeps the value modulo P, so the last lane,
// read as 16 message bytes, leaves the same register as everything it replaced: the tables finish
// from there. Needs n >= 64.
#define DMI_CLMUL __attribute__((target("pclmul,sse4.1")))
DMI_CLMUL inline __m128i crc32_fold(__m128i lane, __m128i k, __m128i next) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(lane, k, 0x00), _mm_clmulepi64_si128(lane, k, 0x11)),
                       next);
}

DMI_CLMUL inline uint32_t crc32_update_clmul(uint32_t crc, const uint8_t* p, size_t n) {
  const auto load = [](const uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
  const auto fold = crc32_fold;
  const __m128i by64 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);
  const __m128i by16 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
  __m128i x0 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(static_cast<int>(crc)));
  __m128i x1 = load(p + 16), x2 = load(p + 32), x3 = load(p + 48);
  p += 64;
  n -= 64;
  for (; n >= 64; p += 64, n -= 64) {
    x0 = fold(x0, by64, load(p));
    x1 = fold(x1, by64, load(p + 16));
    x2 = fold(x2, by64, load(p + 32));
    x3 = fold(x3, by64, load(p + 48));
  }
  x0 = fold(fold(fold(x0, by16, x1), by16, x2), by16, x3);
  for (; n >= 16; p += 16, n -= 16) x0 = fold(x0, by16, load(p));
  alignas(16) uint8_t lane[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(lane), x0);
  return crc32_update_tables(crc32_update_tables(0, lane, 16), p, n);
}

inline bool crc32_has_clmul() {
  static const bool has = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return has;
}
#endif

// CRC-32 of n bytes, as zlib.crc32(bytes) gives it.
inline uint32_t crc32(const uint8_t* p, size_t n) {
#if defined(__x86_64__)
  if (n >= 64 && crc32_has_clmul()) return ~crc32_update_clmul(0xFFFFFFFFu, p, n);
#endif
  return ~crc32_update_tables(0xFFFFFFFFu, p, n);
}

// Product of two polynomials modulo the CRC polynomial, in the reflected bit order CRCs use
// (bit 31 is x^0).
inline uint32_t crc32_mulmod(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = 1u << 31; bit; bit >>= 1) {
    if (a & bit) product ^= b;
    b = (b & 1) ? (b >> 1) ^ 0xEDB88320u : b >> 1;  // b *= x
  }
  return product;
}

// x^(8 * nbytes) modulo the polynomial, by squaring: appending nbytes of data to a message
// multiplies its CRC register by this.
inline uint32_t crc32_shift(uint64_t nbytes) {
  uint32_t result = 1u << 31;  // x^0
  uint32_t power = 1u << 23;   // x^8: one byte
  for (; nbytes; nbytes >>= 1, power = crc32_mulmod(power, power))
    if (nbytes & 1) result = crc32_mulmod(result, power);
  return result;
}

// CRC of A followed by B from crc32(A), crc32(B) and B's length, so one large record can be
// checksummed in pieces on several threads.
inline uint32_t crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return crc32_mulmod(crc32_shift(len_b), crc_a) ^ crc_b;
}

}  // namespace dmi
