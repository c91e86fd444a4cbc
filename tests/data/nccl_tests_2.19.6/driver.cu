// Drives nccl-tests 2.19.6's own JSON writer (src/util.cu, compiled unchanged) the way
// src/common.cu calls it, so that the JSON files next to this one have exactly the structure
// nccl-tests writes: main() -> jsonOutputInit; run() -> writeDeviceReport, writeResultHeader,
// TimeTest (per size: writeBenchmarkLinePreamble, BenchTime out of place then in place, each
// writeBenchmarkLineBody then, with -I, writePerIterReport; writeBenchmarkLineTerminator(iters,
// "")), writeResultFooter, finalizeFooter, writeErrors; main() -> jsonOutputFinalize.
//
// The values (times, bandwidths, argv, env, hostname, device) are this driver's, not a
// measurement: there is no GPU where the fixtures are made.  The CUDA runtime calls util.cu makes
// (cudaGetDeviceCount, cudaGetDeviceProperties, cudaGetErrorString) and the fat-binary
// registration nvcc emits for every .cu file are stubbed below; ncclGetVersion and
// ncclGetLastError are the real libnccl's.
//
// Usage: driver OUT.json 0|1   (the second argument: -I, per-iteration timing)
#include "util.h"

#include <math.h>
#include <string.h>
#include <unistd.h>

// ------------------------------------------------------------ common.cu's globals, -b 8 -e 32
// -f 2 -g 1 -n 4 -w 1 -c 1 (and -I 1 -K 1 for the per-iteration file)
int nThreads = 1;
int nGpus = 1;
size_t minBytes = 8;
size_t maxBytes = 32;
size_t stepBytes = 1 << 20;
size_t stepFactor = 2;
int datacheck = 1;
int warmup_iters = 1;
int iters = 4;
int agg_iters = 1;
int parallel_init = 0;
int blocking_coll = 0;
int per_iter_timing = 0;
int per_iter_skip = 0;
int cudaGraphLaunches = 0;
int unalign = 0;
int test_ncclVersion = 0;
int is_main_proc = 1;
thread_local int is_main_thread = 1;
int test_typenum = 1;
int test_opnum = 1;
const char* test_typenames[ncclNumTypes] = {"float"};
const char* test_opnames[] = {"sum"};

// ------------------------------------------------------------ the CUDA runtime, stubbed
// Named through asm labels: nvcc's front end already defines device-side versions of
// cudaGetDeviceCount and cudaGetErrorString (cuda_device_runtime_api.h), so the host stubs take
// other C++ names and the symbols util.o links against.
extern "C" {
cudaError_t stubGetDeviceCount(int* count) __asm__("cudaGetDeviceCount");
cudaError_t stubGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t stubGetDeviceProperties(struct cudaDeviceProp* prop, int device)
    __asm__("cudaGetDeviceProperties");
cudaError_t stubGetDeviceProperties(struct cudaDeviceProp* prop, int device) {
  memset(prop, 0, sizeof(*prop));
  strcpy(prop->name, "NVIDIA H200");
  prop->pciDomainID = 0;
  prop->pciBusID = 0x1b + device;
  prop->pciDeviceID = 0;
  prop->totalGlobalMem = (size_t)141 << 30;
  return cudaSuccess;
}

const char* stubGetErrorString(cudaError_t error) __asm__("cudaGetErrorString");
const char* stubGetErrorString(cudaError_t error) { return "stub"; }

// util.cu has no kernels, but nvcc registers a fat binary for every .cu file
static void* fatbin_handle = nullptr;
void** CUDARTAPI __cudaRegisterFatBinary(void* fatCubin) { return &fatbin_handle; }
void CUDARTAPI __cudaRegisterFatBinaryEnd(void** fatCubinHandle) {}
void CUDARTAPI __cudaUnregisterFatBinary(void** fatCubinHandle) {}
char CUDARTAPI __cudaInitModule(void** fatCubinHandle) { return 0; }
}

// ------------------------------------------------------------ BenchTime's reporting half
static void benchTime(size_t bytes, int in_place, double* bwSum, int* bwCount) {
  const int nranks = 2;               // all_reduce: busbw = algbw * 2 (n - 1) / n
  double timeUsec = 10.0 + bytes / 8.0 + (in_place ? 0.25 : 0.0);
  double algBw = (double)bytes / 1.0e9 / (timeUsec * 1e-6);
  double busBw = algBw * 2.0 * (nranks - 1) / nranks;
  writeBenchmarkLineBody(timeUsec, algBw, busBw, /*reportErrors=*/datacheck != 0,
                         /*wrongElts=*/0, /*report_cputime=*/false,
                         /*report_timestamps=*/false, /*out_of_place=*/in_place == 0);
  if (per_iter_timing) {              // two process rows, as an MPI run of two processes
    const int nProcs = 2;
    double iterTimes[4], allProcessTimes[2 * 4];
    for (int i = 0; i < iters; i++) {
      allProcessTimes[i] = (timeUsec + (i == 0 ? 3.0 : 0.1 * i)) * 1e-6;
      allProcessTimes[iters + i] = (timeUsec + 0.05 * i) * 1e-6;
      iterTimes[i] = fmax(allProcessTimes[i], allProcessTimes[iters + i]);
    }
    struct IterStats stats;
    computeIterStats(iterTimes + per_iter_skip, iters - per_iter_skip, &stats);
    writePerIterReport(&stats, iterTimes, iters, per_iter_skip, in_place == 0,
                       allProcessTimes, nProcs);
  }
  *bwSum += busBw;
  (*bwCount)++;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s OUT.json 0|1\n", argv[0]);
    return 2;
  }
  per_iter_timing = atoi(argv[2]);
  per_iter_skip = per_iter_timing ? 1 : 0;
  ncclGetVersion(&test_ncclVersion);

  // the command line and environment the file says it ran with (not this process's)
  char* plainArgs[] = {(char*)"./build/all_reduce_perf", (char*)"-b", (char*)"8", (char*)"-e",
                       (char*)"32", (char*)"-f", (char*)"2", (char*)"-g", (char*)"1",
                       (char*)"-n", (char*)"4", (char*)"-c", (char*)"1", (char*)"-J",
                       (char*)"all_reduce.json", nullptr};
  char* iterArgs[] = {(char*)"./build/all_reduce_perf", (char*)"-b", (char*)"8", (char*)"-e",
                      (char*)"32", (char*)"-f", (char*)"2", (char*)"-g", (char*)"1",
                      (char*)"-n", (char*)"4", (char*)"-c", (char*)"1", (char*)"-I",
                      (char*)"1", (char*)"-K", (char*)"1", (char*)"-J",
                      (char*)"all_reduce.json", nullptr};
  char** args = per_iter_timing ? iterArgs : plainArgs;
  int nargs = 0;
  while (args[nargs]) nargs++;
  char* envp[] = {(char*)"NCCL_DEBUG=WARN", (char*)"CUDA_VISIBLE_DEVICES=0", nullptr};

  jsonOutputInit(argv[1], nargs, args, envp);

  // run()
  jsonIdentifyWriter(is_main_thread);
  size_t maxMem = ~(size_t)0;
  if (writeDeviceReport(&maxMem, /*localRank=*/0, /*proc=*/0, /*totalProcs=*/1, /*color=*/0,
                        "node0", "all_reduce_perf") != testSuccess) {
    return 1;
  }
  writeResultHeader(/*report_cputime=*/false, /*report_timestamps=*/false);
  double bw = 0;
  int bwCount = 0;
  for (size_t size = minBytes; size <= maxBytes; size *= stepFactor) {   // TimeTest
    writeBenchmarkLinePreamble(size, size / sizeof(float), "float", "sum", -1);
    benchTime(size, 0, &bw, &bwCount);
    benchTime(size, 1, &bw, &bwCount);
    writeBenchmarkLineTerminator(iters, "");
  }
  int errors[1] = {0};
  bw /= bwCount;
  writeResultFooter(errors, &bw, /*check_avg_bw=*/-1, "all_reduce_perf");
  finalizeFooter();
  writeErrors();

  jsonOutputFinalize();
  return 0;
}
