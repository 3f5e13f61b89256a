"""How fast a sparse step's page reads can be on this machine, whatever the library does: a C++ probe.

A sparse int4 step at 32k × 8 (mha-100m: 12 KV heads × 64) reads, per (sequence, KV head), 64 listed pages of 32
rows out of 1,024. Each page is six runs in today's token-major layout (key codes 1 KB, value codes 1 KB, four
128-byte runs of fp16 scales / zero points). This probe times only the memory side, 2 threads, caches flushed
(256 MB streamed) before every call, medians of 9 interleaved rounds:

* ``token-major``: the six (B, H, T, row) tensors, each listed page's six runs touched line by line, the next
  page's lines prefetched (the library's decode loop);
* ``page-major``: the same bytes, each page one 2.5 KB run (the layout change that docs/sparse.md weighed);
* ``stream``: every page of the same token-major tensors, in order (what a full read streams);
* with 2 MB pages (``madvise(MADV_HUGEPAGE)``, what the library asks for, caches/memory.py) and without; with the
  64 pages chosen at random (sorted, as a step lists them) and as one run of 64 consecutive pages.

Needs g++ with OpenMP; compiles into a temporary directory. Run it alone:

    python benchmarks/probe_page_reads.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

SOURCE = r"""
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include <sys/mman.h>
static const int B = 8, H = 12, T = 32768;
static const int RB[6] = {32, 4, 4, 32, 4, 4};  // bytes per row: key codes, scales, zeros; value codes, ...
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
static volatile uint64_t sink;
static uint64_t touch(const char* p, size_t n) {
  uint64_t s = 0;
  for (size_t o = 0; o < n; o += 64) s += *(const uint64_t*)(p + o);
  return s;
}
static void prefetch(const char* p, size_t n) {
  for (size_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 3);
}
static char* buffer(size_t n, bool huge, int fill) {
  char* p = (char*)aligned_alloc(2 << 20, (n + (2 << 20) - 1) / (2 << 20) * (2 << 20));
  if (huge) madvise(p, n, MADV_HUGEPAGE);
  memset(p, fill, n);
  return p;
}
int main(int argc, char** argv) {
  const int P = atoi(argv[1]);          // rows per page
  const bool huge = atoi(argv[2]) != 0;
  const bool contiguous = atoi(argv[3]) != 0;
  const int NP = T / P, K = 2048 / P, R = 80 * P;  // pages, pages read, bytes per page
  std::vector<char*> A(6);
  for (int i = 0; i < 6; ++i) A[i] = buffer((size_t)B * H * T * RB[i], huge, i + 1);
  char* Bp = buffer((size_t)B * H * NP * R, huge, 7);
  const size_t fl = 256 << 20;
  char* F = buffer(fl, false, 1);
  std::mt19937 rng(1);
  std::vector<int> pages(B * H * K);
  for (int t = 0; t < B * H; ++t) {
    std::vector<int> all(NP);
    for (int i = 0; i < NP; ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), rng);
    std::sort(all.begin(), all.begin() + K);
    for (int k = 0; k < K; ++k) pages[t * K + k] = contiguous ? all[0] % (NP - K) + k : all[k];
  }
  auto flush = [&] {
    uint64_t s = 0;
#pragma omp parallel for reduction(+ : s)
    for (size_t o = 0; o < fl; o += 64) s += F[o];
    sink = s;
  };
  auto token_major = [&] {
    uint64_t s = 0;
#pragma omp parallel for reduction(+ : s) schedule(dynamic, 1)
    for (int t = 0; t < B * H; ++t)
      for (int k = 0; k < K; ++k) {
        if (k + 1 < K)
          for (int i = 0; i < 6; ++i) prefetch(A[i] + ((size_t)t * T + (size_t)pages[t * K + k + 1] * P) * RB[i], P * RB[i]);
        for (int i = 0; i < 6; ++i) s += touch(A[i] + ((size_t)t * T + (size_t)pages[t * K + k] * P) * RB[i], P * RB[i]);
      }
    sink = s;
  };
  auto page_major = [&] {
    uint64_t s = 0;
#pragma omp parallel for reduction(+ : s) schedule(dynamic, 1)
    for (int t = 0; t < B * H; ++t)
      for (int k = 0; k < K; ++k) {
        if (k + 1 < K) prefetch(Bp + ((size_t)t * NP + pages[t * K + k + 1]) * R, R);
        s += touch(Bp + ((size_t)t * NP + pages[t * K + k]) * R, R);
      }
    sink = s;
  };
  auto stream = [&] {
    uint64_t s = 0;
#pragma omp parallel for reduction(+ : s) schedule(dynamic, 1)
    for (int t = 0; t < B * H; ++t)
      for (int i = 0; i < 6; ++i) s += touch(A[i] + (size_t)t * T * RB[i], (size_t)T * RB[i]);
    sink = s;
  };
  std::vector<double> a, b, c;
  for (int r = 0; r < 9; ++r) {
    double t0;
    flush(); t0 = now(); token_major(); a.push_back(now() - t0);
    flush(); t0 = now(); page_major(); b.push_back(now() - t0);
    flush(); t0 = now(); stream(); c.push_back(now() - t0);
  }
  auto med = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2] * 1e3; };
  const double listed = (double)B * H * K * R, all = listed * NP / K;
  printf("%d %d %d %.3f %.1f %.3f %.1f %.3f %.1f\n", P, huge, contiguous, med(a), listed / med(a) / 1e6, med(b),
         listed / med(b) / 1e6, med(c), all / med(c) / 1e6);
}
"""


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # no options: --help only
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "probe.cpp"), os.path.join(d, "probe")
        with open(src, "w") as f:
            f.write(SOURCE)
        subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", src, "-o", exe], check=True)
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        print(f"load {os.getloadavg()[0]:.2f}; threads {env['OMP_NUM_THREADS']}; ms (GB/s) per call, medians of 9")
        print("| rows/page | 2 MB pages | pages | token-major | page-major | stream (all pages) |")
        print("|---|---|---|---|---|---|")
        for page, huge, contiguous in [(32, 1, 0), (32, 0, 0), (32, 1, 1), (32, 0, 1), (128, 1, 0), (16, 1, 0)]:
            out = subprocess.run([exe, str(page), str(huge), str(contiguous)], check=True, env=env,
                                 capture_output=True, text=True).stdout.split()
            p, h, c, ta, ga, tb, gb, ts, gs = out
            print(f"| {p} | {'yes' if h == '1' else 'no'} | {'a run of 64' if c == '1' else 'random'} | "
                  f"{ta} ({ga}) | {tb} ({gb}) | {ts} ({gs}) |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
