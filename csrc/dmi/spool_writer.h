// Native spool writer: a C++ thread that takes finished records from a ring's ready queue and
// writes them straight from staging into raw spool segments, checksummed, with no Python and no
// GIL on the way. Why: every GIL round trip of a Python consumer makes the training thread yield
// the GIL right after a host sync, when the GPU is idle and waiting for its next kernels (measured
// on an H200 as a few percent of step time at 256 MB/step). Python only reads its counters.
//
// Segment file, format 2 (all words little-endian uint64, every block 8-byte aligned; the exact
// layout, enough to decode a segment without this package, is in docs/storage.md):
//   every block starts with magic, a, b, crc: crc is the zlib CRC-32 of magic, a, b and the block's
//   body except payloads (each payload has its own CRC in its descriptor row)
//   header  "DMIRAW02", seq, json_len, crc, json (writer header from Python), pad
//   site    "DMISITE2", site, json_len, crc, json (the site's static key), pad  - before a site's
//           first record in each segment, so every segment stands alone
//   records "DMIRECS2", nrows, payload_bytes, crc, nrows x kTakeWords words (take_into's row
//           layout), payloads back to back, pad
//   footer  "DMIEND02", records, payload_bytes, crc, blocks before it, CRC-32 of their crc words -
//           last; a segment without it was cut short
// Every byte but the payloads is covered by a block CRC, payloads by their own, and the footer's
// totals catch a segment cut at a block boundary.
// A segment is written as `.<seq>.dmiraw.<pid>.tmp` and renamed to `<seq 08d>.dmiraw` when complete
// (its size reached, segment_seconds after its first record, or a flush); a killed process leaves
// only the temporary file. On a write error the segment is cut back to its last whole block and
// kept: only the failing block is lost.
// While held (set_hold, the drain's --dmi-spool-max-gb bound) the writer takes nothing from the
// ring unless a flush or stop waits: the ring fills and its --dmi-on-full policy applies. A flush
// or stop still writes everything published before it, so it can take the spool past the bound.
#pragma once

#include <fcntl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <unordered_map>
#include <unordered_set>

#include "crc32.h"
#include "drain.h"

namespace dmi {

// zlib CRC-32 of each span into crc[i]. Large batches run on a few threads, and spans are cut
// into pieces whose CRCs are combined, so one 32 MiB attention record does not hold up the writer,
// which must keep pace with capture (~2 ms on one core with carry-less multiplication, ~15 ms with
// the tables that hosts without it use).
inline void checksum_spans(const std::vector<const uint8_t*>& ptrs, const std::vector<uint64_t>& lens,
                           std::vector<uint32_t>& crc) {
  const uint64_t kPiece = 4ull << 20, kBytesPerThread = 8ull << 20;
  struct Piece {
    size_t span;
    uint64_t offset, len;
    uint32_t crc;
  };
  std::vector<Piece> pieces;
  uint64_t total = 0;
  for (size_t i = 0; i < ptrs.size(); ++i) {
    total += lens[i];
    uint64_t off = 0;
    do {
      uint64_t len = std::min(kPiece, lens[i] - off);
      pieces.push_back({i, off, len, 0});
      off += len;
    } while (off < lens[i]);
  }
  auto work = [&](size_t first, size_t step) {
    for (size_t k = first; k < pieces.size(); k += step)
      pieces[k].crc = crc32(ptrs[pieces[k].span] + pieces[k].offset, pieces[k].len);
  };
  size_t threads = std::min<size_t>({pieces.size(), 4, static_cast<size_t>(total / kBytesPerThread) + 1});
  std::vector<std::thread> pool;
  for (size_t k = 1; k < threads; ++k) pool.emplace_back(work, k, threads);
  work(0, std::max<size_t>(threads, 1));
  for (auto& th : pool) th.join();
  crc.assign(ptrs.size(), 0);
  for (const Piece& p : pieces)  // pieces are in span order, each span's in offset order
    crc[p.span] = p.offset == 0 ? p.crc : crc32_combine(crc[p.span], p.crc, p.len);
}

struct SpoolConfig {
  std::string dir;          // the rank's spool folder (exists)
  std::string header_json;  // written into every segment's header
  uint64_t first_seq = 1;   // sequence number of the first segment
  uint64_t segment_bytes = 256ull << 20;
  uint64_t linger_bytes = 32ull << 20;  // wait for this much payload per block unless a flush waits
  double poll_s = 0.05;
  double segment_seconds = 2.0;  // a segment also closes this long after its first record (live readers)
};

struct SpoolStats {
  uint64_t records = 0, bytes = 0;                  // in closed segments or the open one
  uint64_t dropped_records = 0, dropped_bytes = 0;  // lost to write errors
  uint64_t segments = 0;                            // closed segments
  uint64_t open_rows = 0;                           // rows in the segment being written
  uint64_t open_bytes = 0;                          // its size on disk so far
  // Where the writer's time goes (wall ns): checksums, writes into the page cache, fsyncs at
  // flushes. Their sum over elapsed time says how close the writer is to falling behind capture.
  uint64_t checksum_ns = 0, write_ns = 0, sync_ns = 0;
  std::vector<std::string> errors;
};

inline uint64_t elapsed_ns(std::chrono::steady_clock::time_point since) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - since).count());
}

class SpoolThread {
 public:
  SpoolThread(RingCore& core, SpoolConfig cfg) : core_(core), cfg_(std::move(cfg)), seq_(cfg_.first_seq) {
    thread_ = std::thread([this] { run(); });
  }
  ~SpoolThread() { stop(); }

  void add_site(uint64_t site, std::string json) {
    std::lock_guard<std::mutex> g(mu_);
    sites_[site] = std::move(json);
  }

  // Wait until every record published before this call is in a closed, fsync'd segment (the
  // caller first synchronises the producing stream). False on timeout or if the thread died.
  bool flush(double timeout_s) {
    std::unique_lock<std::mutex> lk(mu_);
    uint64_t req = ++flush_req_;
    flush_target_ = load_acquire(&core_.shared()->seq);
    core_.wake_takers();
    core_.kick();
    wake_cv_.notify_all();
    return done_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return flush_ack_ >= req || dead_; });
  }

  // Write everything published so far, close the segment and end the thread.
  void stop() {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (stopping_ && !thread_.joinable()) return;
      stopping_ = true;
      flush_target_ = load_acquire(&core_.shared()->seq);
    }
    wake_cv_.notify_all();
    core_.wake_takers();
    if (thread_.joinable()) thread_.join();
  }

  // Held: take nothing from the ring until released, unless a flush or stop waits (those write
  // everything published before them). Aged segments still close while held.
  void set_hold(bool hold) {
    {
      std::lock_guard<std::mutex> g(mu_);
      hold_ = hold;
    }
    wake_cv_.notify_all();
    if (hold) core_.wake_takers();  // end a wait for records now: what is published next stays in the ring
  }

  SpoolStats stats() {
    std::lock_guard<std::mutex> g(mu_);
    return stats_;
  }

  // Segments closed since the last call: (path, rows).
  std::vector<std::pair<std::string, uint64_t>> take_closed() {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<std::pair<std::string, uint64_t>> out;
    out.swap(closed_);
    return out;
  }

 private:
  void run() {
    try {
      loop();
    } catch (const std::exception& ex) {
      std::lock_guard<std::mutex> g(mu_);
      stats_.errors.push_back(std::string("spool writer thread died: ") + ex.what());
    }
    std::lock_guard<std::mutex> g(mu_);
    dead_ = true;
    done_cv_.notify_all();
  }

  void loop() {
    const uint64_t max_batch = std::max<uint64_t>(kSlotAlign, core_.staging_cap() / 4);
    for (;;) {
      const uint64_t epoch = core_.wake_epoch();  // before reading the flush state: no lost wake-up
      uint64_t req, target;
      bool stopping, urgent, held;
      {
        std::lock_guard<std::mutex> g(mu_);
        req = flush_req_;
        target = flush_target_;
        stopping = stopping_;
        urgent = stopping || req > flush_ack_;
        held = hold_ && !urgent;
      }
      bool wrote = false;
      if (!held && (!urgent || core_.taken() < target)) {
        std::lock_guard<std::mutex> take_lock(core_.take_mu());
        uint64_t too_big = 0;
        std::vector<Entry> got =
            core_.pop_ready(1024, cfg_.poll_s, max_batch, &too_big, urgent ? 0 : cfg_.linger_bytes, &epoch);
        if (got.empty() && too_big) got = core_.pop_ready(1, 0.0, UINT64_MAX);
        if (!got.empty()) {
          if (fd_ < 0) segment_opened_ = std::chrono::steady_clock::now();
          write_block(got);
          core_.release_staging(got);
          wrote = true;
        }
      }
      if ((wrote && file_bytes_ >= cfg_.segment_bytes) ||
          (fd_ >= 0 && elapsed_ns(segment_opened_) >= static_cast<uint64_t>(cfg_.segment_seconds * 1e9)))
        close_segment();
      if (urgent && core_.taken() >= target) {
        if (!core_.error().empty()) throw std::runtime_error("ring drain failed: " + core_.error());
        close_segment();
        sync_closed();
        std::lock_guard<std::mutex> g(mu_);
        flush_ack_ = req;
        done_cv_.notify_all();
        if (stopping) return;
      } else if (urgent && !wrote && !core_.error().empty()) {
        throw std::runtime_error("ring drain failed: " + core_.error());
      }
      if (held) {
        std::unique_lock<std::mutex> lk(mu_);
        wake_cv_.wait_for(lk, std::chrono::duration<double>(cfg_.poll_s),
                          [&] { return !hold_ || stopping_ || flush_req_ > flush_ack_; });
      }
    }
  }

  void error(const std::string& what) {
    std::lock_guard<std::mutex> g(mu_);
    if (stats_.errors.size() < 100) stats_.errors.push_back(what);
  }

  bool open_segment() {
    char name[64];
    std::snprintf(name, sizeof(name), "%08llu.dmiraw", static_cast<unsigned long long>(seq_));
    final_ = cfg_.dir + "/" + name;
    tmp_ = cfg_.dir + "/." + name + "." + std::to_string(getpid()) + ".tmp";
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      error("cannot create spool segment " + tmp_ + " (" + why(errno) + ")");
      return false;
    }
    file_bytes_ = 0;
    segment_rows_ = 0;
    segment_bytes_ = 0;
    segment_sites_.clear();
    block_crcs_.clear();
    std::string block = json_block("DMIRAW02", seq_, cfg_.header_json);
    std::vector<iovec> iov{{block.data(), block.size()}};
    if (!write_iov(iov)) {
      error("cannot write spool segment " + tmp_ + " (" + why(errno) + ")");
      ::close(fd_);
      ::unlink(tmp_.c_str());
      fd_ = -1;
      return false;
    }
    block_crcs_.push_back(block_crc(block.data()));
    return true;
  }

  void write_block(const std::vector<Entry>& got) {
    uint64_t rows = got.size(), payload = 0;
    std::vector<const uint8_t*> ptrs(rows);
    std::vector<uint64_t> lens(rows);
    for (size_t i = 0; i < rows; ++i) {
      ptrs[i] = core_.staging() + got[i].staging_off;
      lens[i] = got[i].d.nbytes;
      payload += lens[i];
    }
    std::vector<uint32_t> crc;
    auto t0 = std::chrono::steady_clock::now();
    checksum_spans(ptrs, lens, crc);
    const uint64_t checksum_ns = elapsed_ns(t0);
    if (fd_ < 0 && !open_segment()) {
      error(std::to_string(rows) + " record(s) could not be spooled; those rows are DROPPED");
      return drop(rows, payload);
    }
    // Site definitions this segment has not seen yet.
    std::string sites;
    std::vector<uint64_t> crcs;  // of the blocks below, in file order
    {
      std::lock_guard<std::mutex> g(mu_);
      for (const Entry& e : got) {
        if (!segment_sites_.insert(e.d.site).second) continue;
        auto it = sites_.find(e.d.site);
        const std::string& js = it == sites_.end() ? empty_json_ : it->second;
        const std::string block = json_block("DMISITE2", e.d.site, js);
        crcs.push_back(block_crc(block.data()));
        sites += block;
      }
    }
    std::vector<uint64_t> words;
    words.reserve(rows * kTakeWords);
    for (size_t i = 0; i < rows; ++i) append_take_row(got[i], crc[i], words);
    std::string head = sealed_head("DMIRECS2", rows, payload, words.data(), words.size() * sizeof(uint64_t));
    crcs.push_back(block_crc(head.data()));
    static const char zeros[8] = {0};
    std::vector<iovec> iov{{sites.data(), sites.size()}, {head.data(), head.size()},
                           {words.data(), words.size() * sizeof(uint64_t)}};
    for (size_t i = 0; i < rows; ++i)
      if (lens[i]) iov.push_back({const_cast<uint8_t*>(ptrs[i]), lens[i]});
    if (pad8(payload)) iov.push_back({const_cast<char*>(zeros), pad8(payload)});
    uint64_t good = file_bytes_;
    t0 = std::chrono::steady_clock::now();
    const bool written = write_iov(iov);
    {
      std::lock_guard<std::mutex> g(mu_);
      stats_.checksum_ns += checksum_ns;
      stats_.write_ns += elapsed_ns(t0);
    }
    if (!written) {
      error("cannot write " + std::to_string(rows) + " record(s) to spool segment " + tmp_ + " (" + why(errno) +
            "); those rows are DROPPED, the segment keeps what it had");
      drop(rows, payload);
      // Cut back to the last whole block and close: the next segment starts clean. If even that
      // fails, the segment cannot be trusted: it goes, and its records count as dropped.
      if (::ftruncate(fd_, static_cast<off_t>(good)) == 0) {
        file_bytes_ = good;
        close_segment();
        return;
      }
      discard_segment("cannot cut spool segment " + tmp_ + " back (" + why(errno) + ")");
      return;
    }
    segment_rows_ += rows;
    segment_bytes_ += payload;
    block_crcs_.insert(block_crcs_.end(), crcs.begin(), crcs.end());
    std::lock_guard<std::mutex> g(mu_);
    stats_.records += rows;
    stats_.bytes += payload;
    stats_.open_rows = segment_rows_;
    stats_.open_bytes = file_bytes_;
  }

  void drop(uint64_t rows, uint64_t bytes) {
    std::lock_guard<std::mutex> g(mu_);
    stats_.dropped_records += rows;
    stats_.dropped_bytes += bytes;
  }

  // The open segment cannot be kept: remove it and count its records as dropped.
  void discard_segment(const std::string& what) {
    error(what + "; its " + std::to_string(segment_rows_) + " record(s) are DROPPED");
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    ::unlink(tmp_.c_str());
    std::lock_guard<std::mutex> g(mu_);
    stats_.records -= segment_rows_;
    stats_.bytes -= segment_bytes_;
    stats_.dropped_records += segment_rows_;
    stats_.dropped_bytes += segment_bytes_;
    stats_.open_rows = 0;
    stats_.open_bytes = 0;
  }

  void close_segment() {
    if (fd_ < 0) return;
    if (segment_rows_ == 0) {  // nothing but a header: not worth a file
      ::close(fd_);
      fd_ = -1;
      ::unlink(tmp_.c_str());
      return;
    }
    const uint64_t good = file_bytes_;
    if (!write_footer()) {  // kept: its blocks verify on their own; the reader reports it as cut short
      error("cannot write the footer of spool segment " + tmp_ + " (" + why(errno) +
            "); its records are kept, the segment will be reported as cut short");
      if (::ftruncate(fd_, static_cast<off_t>(good)) == 0) file_bytes_ = good;
    }
    ::close(fd_);
    fd_ = -1;
    if (::rename(tmp_.c_str(), final_.c_str()) != 0) {
      discard_segment("cannot rename spool segment " + tmp_ + " (" + why(errno) + ")");
      return;
    }
    ++seq_;
    unsynced_.push_back(final_);
    std::lock_guard<std::mutex> g(mu_);
    stats_.segments += 1;
    stats_.open_rows = 0;
    stats_.open_bytes = 0;
    closed_.emplace_back(final_, segment_rows_);
  }

  // fsync the segments closed since the last flush, then the folder (a segment already ingested
  // and deleted needs nothing).
  void sync_closed() {
    auto t0 = std::chrono::steady_clock::now();
    for (const std::string& path : unsynced_) {
      int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      if (::fsync(fd) != 0) error("fsync of spool segment " + path + " failed: " + std::strerror(errno));
      ::close(fd);
    }
    if (!unsynced_.empty()) {
      int fd = ::open(cfg_.dir.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd >= 0) {
        ::fsync(fd);
        ::close(fd);
      }
    }
    unsynced_.clear();
    std::lock_guard<std::mutex> g(mu_);
    stats_.sync_ns += elapsed_ns(t0);
  }

  bool write_iov(std::vector<iovec>& iov) {
    size_t i = 0;
    while (i < iov.size()) {
      int n = static_cast<int>(std::min<size_t>(iov.size() - i, IOV_MAX));
      ssize_t w = ::writev(fd_, &iov[i], n);
      if (w < 0) {
        if (errno == EINTR) continue;
        return false;
      }
      file_bytes_ += static_cast<uint64_t>(w);
      size_t left = static_cast<size_t>(w);
      while (i < iov.size() && left >= iov[i].iov_len) left -= iov[i++].iov_len;
      if (left) {  // short write: continue inside iov[i]
        iov[i].iov_base = static_cast<char*>(iov[i].iov_base) + left;
        iov[i].iov_len -= left;
      }
      if (w == 0) {
        errno = ENOSPC;
        return false;
      }
    }
    return true;
  }

  static std::string why(int err) { return err == ENOSPC ? "disk full" : std::strerror(err); }

  static uint64_t pad8(uint64_t n) { return (8 - n % 8) % 8; }

  // -- format 2 blocks: head (magic, a, b, crc) over the body; see the layout at the top ------
  static constexpr size_t kHeadBytes = 32;

  // A block head whose crc word covers magic, a, b and `body`.
  static std::string sealed_head(const char magic[8], uint64_t a, uint64_t b, const void* body, size_t len) {
    std::string s(kHeadBytes, '\0');
    std::memcpy(&s[0], magic, 8);
    std::memcpy(&s[8], &a, 8);
    std::memcpy(&s[16], &b, 8);
    uint32_t crc = crc32(reinterpret_cast<const uint8_t*>(s.data()), 24);
    if (len) crc = crc32_combine(crc, crc32(static_cast<const uint8_t*>(body), len), len);
    const uint64_t word = crc;
    std::memcpy(&s[24], &word, 8);
    return s;
  }

  // A whole block whose body is `json`, zero-padded to 8 bytes (header and site blocks).
  static std::string json_block(const char magic[8], uint64_t a, const std::string& json) {
    std::string body = json + std::string(pad8(json.size()), '\0');
    return sealed_head(magic, a, json.size(), body.data(), body.size()) + body;
  }

  static uint64_t block_crc(const char* head) {
    uint64_t word;
    std::memcpy(&word, head + 24, 8);
    return word;
  }

  // The footer: totals, and a CRC over every block's crc word, so a segment cut at a block
  // boundary, or with a block missing, does not pass for whole.
  bool write_footer() {
    const uint64_t body[2] = {block_crcs_.size(), crc32(reinterpret_cast<const uint8_t*>(block_crcs_.data()),
                                    block_crcs_.size() * sizeof(uint64_t))};
    std::string block = sealed_head("DMIEND02", segment_rows_, segment_bytes_, body, sizeof(body));
    block.append(reinterpret_cast<const char*>(body), sizeof(body));
    std::vector<iovec> iov{{block.data(), block.size()}};
    return write_iov(iov);
  }

  RingCore& core_;
  SpoolConfig cfg_;
  uint64_t seq_;
  std::thread thread_;

  std::mutex mu_;  // guards the fields below this line and sites_
  std::condition_variable done_cv_;
  std::condition_variable wake_cv_;  // ends a held writer's wait: released, flush, stop
  std::unordered_map<uint64_t, std::string> sites_;
  uint64_t flush_req_ = 0, flush_ack_ = 0, flush_target_ = 0;
  bool stopping_ = false, dead_ = false, hold_ = false;
  SpoolStats stats_;
  std::vector<std::pair<std::string, uint64_t>> closed_;

  // writer thread only
  int fd_ = -1;
  uint64_t file_bytes_ = 0, segment_rows_ = 0, segment_bytes_ = 0;  // file size; records and payload in it
  std::string tmp_, final_;
  std::unordered_set<uint64_t> segment_sites_;
  std::chrono::steady_clock::time_point segment_opened_;  // first write into the open segment
  std::vector<std::string> unsynced_;
  std::vector<uint64_t> block_crcs_;  // crc words of this segment's blocks so far
  const std::string empty_json_ = "{}";
};

}  // namespace dmi
