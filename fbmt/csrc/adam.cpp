// fbmt._C: fused CPU Adam/AdamW over raw buffers, for optimizer offload.
//
// No libtorch: the Python side passes data pointers (tensor.data_ptr()) and sizes, so this module
// is independent of the torch build it runs beside (no ABI coupling, no `undefined symbol`).
//
// One pass over memory per element: read grad (fp32/bf16/fp16), master, m, v; write master, m, v
// and optionally the parameter in bf16/fp16 (round to nearest even). Loss-scale unscaling is folded
// in, and non-finite gradients are detected in the same loop ("report") or by a scan of the
// gradients before any write ("skip": an overflowed step then changes nothing).
//
// The kernel is written once as a plain loop and compiled three times with different target
// attributes (AVX-512, AVX2+FMA+F16C, baseline x86-64); GCC vectorizes each. The level is chosen at
// run time from the CPU's features, and can be forced for tests. Work is split over threads, as many
// as the process's CPU affinity allows.

#include <pybind11/pybind11.h>

#include <emmintrin.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };
enum Level : int { kBaseline = 0, kAVX2 = 1, kAVX512 = 2 };
enum Check : int { kNoCheck = 0, kReport = 1, kSkip = 2 };

struct Hyper {
  float lr, beta2, one_b1, one_b2, decay, eps, wd, step_size, bc2_sqrt, inv_scale;  // scalars rounded once from double, as torch does
  bool decoupled;
};

struct Job {
  float* master;
  float* m;
  float* v;
  const void* grad;
  void* out;
  int grad_dtype, out_dtype;
};

// ---- element conversions (all branch-free, so the loops vectorize) ----
#define FBMT_INLINE static inline __attribute__((always_inline))

FBMT_INLINE float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

FBMT_INLINE uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

FBMT_INLINE float load(const float* p, int64_t i) { return p[i]; }
FBMT_INLINE float load(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }
FBMT_INLINE float load(const _Float16* p, int64_t i) { return static_cast<float>(p[i]); }
FBMT_INLINE void store(uint16_t* p, int64_t i, float x) { p[i] = f32_to_bf16(x); }
FBMT_INLINE void store(_Float16* p, int64_t i, float x) { p[i] = static_cast<_Float16>(x); }
FBMT_INLINE void store(float* p, int64_t i, float x) { p[i] = x; }

// Non-finite <=> all exponent bits set, tested on the stored bits (an integer OR reduction).
FBMT_INLINE uint32_t nonfinite(const float* p, int64_t i) {
  uint32_t u;
  std::memcpy(&u, p + i, 4);
  return (u & 0x7f800000u) == 0x7f800000u;
}
FBMT_INLINE uint32_t nonfinite(const uint16_t* p, int64_t i) { return (p[i] & 0x7f80u) == 0x7f80u; }
FBMT_INLINE uint32_t nonfinite(const _Float16* p, int64_t i) {
  uint16_t u;
  std::memcpy(&u, p + i, 2);
  return (u & 0x7c00u) == 0x7c00u;
}

struct NoOut {};
FBMT_INLINE void store(NoOut*, int64_t, float) {}

template <typename G>
FBMT_INLINE uint32_t scan(const G* __restrict g, int64_t lo, int64_t hi) {
  uint32_t bad = 0;
  for (int64_t i = lo; i < hi; ++i) bad |= nonfinite(g, i);
  return bad;
}

// The update, matching torch.optim.Adam/AdamW (foreach/fused) formula for formula.
template <typename G, typename P, bool kDecoupled, bool kReportCheck>
FBMT_INLINE uint32_t update(float* __restrict master, float* __restrict m, float* __restrict v,
                            const G* __restrict g, P* __restrict out, int64_t lo, int64_t hi, const Hyper& h) {
  const float b2 = h.beta2, one_b1 = h.one_b1, one_b2 = h.one_b2;
  const float decay = h.decay, wd = h.wd, eps = h.eps, step = h.step_size;
  const float bc2_sqrt = h.bc2_sqrt, inv_scale = h.inv_scale;
  uint32_t bad = 0;
  for (int64_t i = lo; i < hi; ++i) {
    if (kReportCheck) bad |= nonfinite(g, i);
    float gi = load(g, i) * inv_scale;
    float p = master[i];
    if (!kDecoupled) gi = gi + wd * p;  // L2: decay through the gradient (torch.optim.Adam)
    float mi = m[i] + one_b1 * (gi - m[i]);  // torch: exp_avg.lerp_(grad, 1 - beta1)
    float vi = b2 * v[i] + one_b2 * gi * gi;   // torch: exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
    m[i] = mi;
    v[i] = vi;
    if (kDecoupled) p = p * decay;  // AdamW: decay the weight itself
    p = p - step * (mi / (std::sqrt(vi) / bc2_sqrt + eps));
    master[i] = p;
    store(out, i, p);
  }
  return bad;
}

// NOTE: [Streaming the low-precision parameter]
// The bf16/fp16 parameter is only written, never read, so an ordinary store first reads each cache
// line in (read-for-ownership): 2 more bytes per element on top of the 28 the update must move.
// For 16-bit outputs we update blocks of 256 elements into an L1 buffer, round them there, and write
// the block with non-temporal stores (SSE2's, available on every x86-64 level), which skip that read.
template <typename G, typename P, bool kDecoupled, bool kReportCheck>
FBMT_INLINE uint32_t update_streaming(float* master, float* m, float* v, const G* g, P* out, int64_t lo,
                                      int64_t hi, const Hyper& h) {
  constexpr int64_t kBlock = 256;
  alignas(64) float buf[kBlock];
  alignas(64) P rounded[kBlock];
  int64_t i = lo;
  uint32_t bad = 0;
  while (i < hi && (reinterpret_cast<uintptr_t>(out + i) & 15) != 0) {  // head: up to 16-byte alignment
    bad |= update<G, P, kDecoupled, kReportCheck>(master, m, v, g, out, i, i + 1, h);
    ++i;
  }
  for (; i + kBlock <= hi; i += kBlock) {
    bad |= update<G, float, kDecoupled, kReportCheck>(master + i, m + i, v + i, g + i, buf, 0, kBlock, h);
    for (int64_t k = 0; k < kBlock; ++k) store(rounded, k, buf[k]);
    auto* src = reinterpret_cast<const __m128i*>(rounded);
    auto* dst = reinterpret_cast<__m128i*>(out + i);
    for (int q = 0; q < static_cast<int>(kBlock * sizeof(P) / 16); ++q) _mm_stream_si128(dst + q, _mm_load_si128(src + q));
  }
  bad |= update<G, P, kDecoupled, kReportCheck>(master, m, v, g, out, i, hi, h);  // tail
  _mm_sfence();  // order the streaming stores before the caller reads the parameter
  return bad;
}

template <typename G, typename P, bool kDecoupled, bool kReportCheck>
FBMT_INLINE uint32_t update_any(float* master, float* m, float* v, const G* g, P* out, int64_t lo, int64_t hi,
                                const Hyper& h) {
  if constexpr (sizeof(P) == 2) {
    return update_streaming<G, P, kDecoupled, kReportCheck>(master, m, v, g, out, lo, hi, h);
  } else {
    return update<G, P, kDecoupled, kReportCheck>(master, m, v, g, out, lo, hi, h);
  }
}

template <typename G, typename P>
FBMT_INLINE uint32_t update_range(const Job& j, int64_t lo, int64_t hi, const Hyper& h, bool report) {
  auto* g = static_cast<const G*>(j.grad);
  auto* o = static_cast<P*>(j.out);
  if (h.decoupled) {
    return report ? update_any<G, P, true, true>(j.master, j.m, j.v, g, o, lo, hi, h)
                  : update_any<G, P, true, false>(j.master, j.m, j.v, g, o, lo, hi, h);
  }
  return report ? update_any<G, P, false, true>(j.master, j.m, j.v, g, o, lo, hi, h)
                : update_any<G, P, false, false>(j.master, j.m, j.v, g, o, lo, hi, h);
}

template <typename G>
FBMT_INLINE uint32_t update_out(const Job& j, int64_t lo, int64_t hi, const Hyper& h, bool report) {
  switch (j.out_dtype) {
    case kBF16: return update_range<G, uint16_t>(j, lo, hi, h, report);
    case kF16: return update_range<G, _Float16>(j, lo, hi, h, report);
    case kF32: return update_range<G, float>(j, lo, hi, h, report);
    default: return update_range<G, NoOut>(j, lo, hi, h, report);
  }
}

FBMT_INLINE uint32_t body_update(const Job& j, int64_t lo, int64_t hi, const Hyper& h, bool report) {
  switch (j.grad_dtype) {
    case kBF16: return update_out<uint16_t>(j, lo, hi, h, report);
    case kF16: return update_out<_Float16>(j, lo, hi, h, report);
    default: return update_out<float>(j, lo, hi, h, report);
  }
}

FBMT_INLINE uint32_t body_scan(const Job& j, int64_t lo, int64_t hi) {
  switch (j.grad_dtype) {
    case kBF16: return scan(static_cast<const uint16_t*>(j.grad), lo, hi);
    case kF16: return scan(static_cast<const _Float16*>(j.grad), lo, hi);
    default: return scan(static_cast<const float*>(j.grad), lo, hi);
  }
}

// Three compilations of the same bodies. prefer-vector-width=512 makes GCC use zmm registers.
#define FBMT_LEVEL(name, isa)                                                                  \
  __attribute__((target(isa))) uint32_t update_##name(const Job& j, int64_t lo, int64_t hi,    \
                                                      const Hyper& h, bool report) {           \
    return body_update(j, lo, hi, h, report);                                                 \
  }                                                                                            \
  __attribute__((target(isa))) uint32_t scan_##name(const Job& j, int64_t lo, int64_t hi) {    \
    return body_scan(j, lo, hi);                                                              \
  }

FBMT_LEVEL(avx512, "avx512f,avx512bw,avx512vl,avx2,fma,f16c,prefer-vector-width=512")
FBMT_LEVEL(avx2, "avx2,fma,f16c")
FBMT_LEVEL(baseline, "arch=x86-64")

using UpdateFn = uint32_t (*)(const Job&, int64_t, int64_t, const Hyper&, bool);
using ScanFn = uint32_t (*)(const Job&, int64_t, int64_t);

int detect_level() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma"))
    return kAVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return kAVX2;
  return kBaseline;
}

const int kMaxLevel = detect_level();
std::atomic<int> g_level{kMaxLevel};

int affinity_threads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// NOTE: [A persistent thread pool]
// Spawning threads per call costs tens of microseconds each, paid by the offload pipeline once per
// chunk: with many threads and small chunks that outweighs the update (BENCHMARKS.md). Workers are started once, wait on a condition variable for a generation
// number to change, run their share and report back. The pool is leaked on purpose (its detached
// threads die with the process: no join at exit) and rebuilt if a forked child calls in.
class Pool {
 public:
  template <typename Fn>
  void run(int tasks, Fn& fn) {  // fn(k) for k in [0, tasks): the caller runs k = 0
    std::lock_guard<std::mutex> one_region(call_mu_);
    grow(tasks - 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      task_ = [&fn](int k) { fn(k); };
      tasks_ = tasks;
      pending_ = tasks - 1;
      ++generation_;
    }
    cv_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [this] { return pending_ == 0; });
    task_ = nullptr;
  }

 private:
  void grow(int workers) {
    while (static_cast<int>(started_) < workers) {
      int k = static_cast<int>(++started_);  // worker k runs task k
      std::thread([this, k] { loop(k); }).detach();
    }
  }
  void loop(int k) {
    uint64_t seen = 0;
    for (;;) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (k >= tasks_) continue;
      auto task = task_;
      lock.unlock();
      task(k);
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }
  std::mutex call_mu_, mu_;
  std::condition_variable cv_, done_;
  std::function<void(int)> task_;
  uint64_t generation_ = 0;
  int tasks_ = 0, pending_ = 0;
  std::atomic<unsigned> started_{0};
};

Pool& pool() {
  static Pool* p = new Pool();  // leaked: see the NOTE
  static pid_t owner = getpid();
  if (getpid() != owner) {  // a forked child: the parent's workers do not exist here
    p = new Pool();
    owner = getpid();
  }
  return *p;
}

// NOTE: [Chunks taken in turn]
// [0, n) is cut into 64-element-aligned chunks of about a megabyte of each array, and each thread takes
// the next chunk from a shared counter until none is left. With a fixed half per thread, a thread whose
// CPU is busy (another library's pool still spinning after its own parallel region, a noisy
// neighbour) held the whole call back; taken in turn, the others do its share. Chunks this size keep
// the counter's cost (one atomic per chunk) and the hardware prefetchers' restarts negligible.
template <typename Fn>
uint32_t parallel(int64_t n, int threads, Fn fn) {
  constexpr int64_t kMinPerThread = 1 << 16, kChunk = 1 << 18, kAlign = 64;
  int t = static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(1, n / kMinPerThread)));
  if (t <= 1) return fn(0, n);
  int64_t chunk = std::min<int64_t>(kChunk, ((n + t - 1) / t + kAlign - 1) / kAlign * kAlign);
  int64_t chunks = (n + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  std::vector<uint32_t> bad(t, 0);
  auto work = [&](int k) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      bad[k] |= fn(c * chunk, std::min(n, (c + 1) * chunk));
    }
  };
  pool().run(t, work);
  uint32_t any = 0;
  for (uint32_t b : bad) any |= b;
  return any;
}

bool adam_step(uintptr_t master, uintptr_t m, uintptr_t v, uintptr_t grad, int grad_dtype, uintptr_t out,
               int out_dtype, int64_t n, double lr, double beta1, double beta2, double eps, double weight_decay,
               int64_t step, double inv_scale, bool decoupled, int check, int threads) {
  if (step < 1) throw std::invalid_argument("adam_step: step must be >= 1 (it counts from 1)");
  if (grad_dtype < kF32 || grad_dtype > kF16) throw std::invalid_argument("adam_step: bad grad dtype code");
  if (out_dtype < kF32 || out_dtype > kNone) throw std::invalid_argument("adam_step: bad out dtype code");
  if (check < kNoCheck || check > kSkip) throw std::invalid_argument("adam_step: bad check mode");
  Job j{reinterpret_cast<float*>(master), reinterpret_cast<float*>(m), reinterpret_cast<float*>(v),
        reinterpret_cast<const void*>(grad), reinterpret_cast<void*>(out), grad_dtype,
        out ? out_dtype : static_cast<int>(kNone)};
  double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  auto f = [](double x) { return static_cast<float>(x); };
  Hyper h{f(lr), f(beta2), f(1.0 - beta1), f(1.0 - beta2), f(1.0 - lr * weight_decay), f(eps), f(weight_decay),
          f(lr / bc1), f(std::sqrt(bc2)), f(inv_scale), decoupled};
  int level = g_level.load();
  UpdateFn upd = level == kAVX512 ? update_avx512 : level == kAVX2 ? update_avx2 : update_baseline;
  ScanFn scn = level == kAVX512 ? scan_avx512 : level == kAVX2 ? scan_avx2 : scan_baseline;
  int t = threads > 0 ? threads : affinity_threads();
  py::gil_scoped_release release;  // pure C++ from here: other Python threads (CUDA copies) run on
  if (check == kSkip && parallel(n, t, [&](int64_t lo, int64_t hi) { return scn(j, lo, hi); })) return true;
  bool report = check == kReport;
  return parallel(n, t, [&](int64_t lo, int64_t hi) { return upd(j, lo, hi, h, report); }) != 0;
}

bool has_nonfinite(uintptr_t grad, int grad_dtype, int64_t n, int threads) {
  if (grad_dtype < kF32 || grad_dtype > kF16) throw std::invalid_argument("has_nonfinite: bad dtype code");
  Job j{nullptr, nullptr, nullptr, reinterpret_cast<const void*>(grad), nullptr, grad_dtype, kNone};
  int level = g_level.load();
  ScanFn scn = level == kAVX512 ? scan_avx512 : level == kAVX2 ? scan_avx2 : scan_baseline;
  py::gil_scoped_release release;
  return parallel(n, threads > 0 ? threads : affinity_threads(), [&](int64_t lo, int64_t hi) { return scn(j, lo, hi); });
}

}  // namespace

PYBIND11_MODULE(_C, mod) {
  mod.doc() = "fbmt native runtime: fused CPU Adam over raw buffers (no libtorch)";
  mod.def("adam_step", &adam_step, py::arg("master"), py::arg("m"), py::arg("v"), py::arg("grad"),
          py::arg("grad_dtype"), py::arg("out"), py::arg("out_dtype"), py::arg("n"), py::arg("lr"), py::arg("beta1"),
          py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"), py::arg("inv_scale"),
          py::arg("decoupled"), py::arg("check"), py::arg("threads"),
          "One fused Adam step over n elements; returns True if a gradient was inf/nan (see check).");
  mod.def("has_nonfinite", &has_nonfinite, py::arg("grad"), py::arg("grad_dtype"), py::arg("n"), py::arg("threads"),
          "True if any of n gradient elements is inf or nan.");
  mod.def("max_simd_level", [] { return kMaxLevel; }, "The best level this CPU supports: 0 baseline, 1 AVX2, 2 AVX-512.");
  mod.def("simd_level", [] { return g_level.load(); });
  mod.def("set_simd_level", [](int level) {
    if (level < kBaseline || level > kMaxLevel)
      throw std::invalid_argument("set_simd_level: this CPU supports levels 0.." + std::to_string(kMaxLevel));
    return g_level.exchange(level);
  }, "Force a dispatch level (for tests and benchmarks); returns the previous one.");
  mod.def("affinity_threads", &affinity_threads, "Threads the kernel uses by default: the CPUs this process may run on.");
}
