// CRC-32 as zlib.crc32 computes it (IEEE 802.3 polynomial, reflected: 0xEDB88320; initial and final
// value all ones), with slicing-by-8 tables. The consumer checksums payloads here, inside the one
// GIL-free call that takes a batch: a Python-side zlib.crc32 per record released and re-took the GIL
// once per record, and every re-take from a background thread stalls the training thread's launches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

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

// Little-endian hosts only (x86-64, aarch64), like the rest of the payload format.
inline uint32_t crc32(const uint8_t* p, size_t n) {
  const auto& t = crc32_tables().t;
  uint32_t crc = 0xFFFFFFFFu;
  for (; n && (reinterpret_cast<uintptr_t>(p) & 7); --n) crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= crc;
    crc = t[7][v & 0xff] ^ t[6][(v >> 8) & 0xff] ^ t[5][(v >> 16) & 0xff] ^ t[4][(v >> 24) & 0xff] ^
          t[3][(v >> 32) & 0xff] ^ t[2][(v >> 40) & 0xff] ^ t[1][(v >> 48) & 0xff] ^ t[0][v >> 56];
  }
  for (; n; --n) crc = t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
  return ~crc;
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
