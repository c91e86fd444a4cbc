"""Which reduction ops must work on which dtypes: the GPU matrix's expectation, written out here
from NCCL's and torch.distributed's rules -- never read from ncclpy, whose refusals it judges (a
wrong refusal must fail a check, not pass it).  Imports nothing: the GPU workers and the CPU
test that holds ncclpy's refusals to it (tests/test_op_rules.py) both use it.

NCCL 2.28.9 (``git show v2.28.9-1:src/enqueue.cc``, ``hostToDevRedOp``; ``src/device/onerank.cu``):

* ncclSum, ncclProd, ncclMax, ncclMin and ncclAvg are valid for every ``ncclDataType_t`` (float8
  reductions need every GPU of the communicator at sm90 or newer: ``taskAppend`` refuses them with
  4, "FP8 reduction support begins with sm90 capable devices."; the matrix skips float8 on an
  older local GPU, which is the communicator's minimum on the one-GPU machine it runs on): avg is
  ``SumPostDiv`` on the integer types and ``PreMulSum`` by 1/n on the floating ones (float8
  included); ``ncclRedOpCreatePreMulSum`` makes a PreMulSum op for any datatype;
* on a one-rank communicator a PreMulSum op (avg on a float, premul_sum) runs through
  ``ncclLaunchOneRank``, whose float8 kernels exist only where ``__CUDA_ARCH__ >= 900`` -- never
  in the host code that picks the kernel -- so float8 avg and premul_sum on one rank return
  ncclInvalidArgument;
* since: ncclAvg 2.10.0, ncclRedOpCreatePreMulSum 2.11.0, ncclBfloat16 2.10.0, the float8
  types 2.24.0.

torch.distributed's rules, which ncclpy follows for the dtypes NCCL lacks:

* bool travels as uint8 (torch's ``getNcclReduceOp`` maps sum to ncclMax and keeps prod as
  ncclProd; ncclpy maps prod to min, the same on 0/1 values), so those four work; avg and
  premul_sum are refused;
* complex travels as pairs of floats: sum, avg and premul_sum (a real scalar) work; prod, max
  and min are refused (torch: "all_reduce does not support ... on complex tensors").
"""
from __future__ import annotations

OPS = ("sum", "prod", "max", "min", "avg", "premul_sum")
NCCL_TYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32",
              "float64", "bfloat16", "float8_e4m3", "float8_e5m2")

#: dtype -> the ops that must work on it (given the NCCL version and world size below)
VALID = {
    "int8": set(OPS), "uint8": set(OPS), "int32": set(OPS), "uint32": set(OPS),
    "int64": set(OPS), "uint64": set(OPS), "float16": set(OPS), "float32": set(OPS),
    "float64": set(OPS), "bfloat16": set(OPS), "float8_e4m3": set(OPS), "float8_e5m2": set(OPS),
    "bool": {"sum", "prod", "max", "min"},
    "complex32": {"sum", "avg", "premul_sum"},
    "complex64": {"sum", "avg", "premul_sum"},
    "complex128": {"sum", "avg", "premul_sum"},
}
#: NCCL_VERSION_CODE from which an op / a dtype's wire type exists
OP_SINCE = {"avg": 21000, "premul_sum": 21100}
DTYPE_SINCE = {"bfloat16": 21000, "float8_e4m3": 22400, "float8_e5m2": 22400}
#: (dtype, op) NCCL refuses on a one-rank communicator
ONE_RANK_REFUSED = {("float8_e4m3", "avg"), ("float8_e4m3", "premul_sum"),
                    ("float8_e5m2", "avg"), ("float8_e5m2", "premul_sum")}


def must_work(dtype: str, op: str, nccl_version: int, world_size: int) -> bool:
    """Whether ``op`` on ``dtype`` must be accepted (and give the right result) with NCCL
    ``nccl_version`` on ``world_size`` ranks; where not, ncclpy must refuse it up front."""
    if op not in VALID[dtype]:
        return False
    if nccl_version < OP_SINCE.get(op, 0) or nccl_version < DTYPE_SINCE.get(dtype, 0):
        return False
    return not (world_size == 1 and (dtype, op) in ONE_RANK_REFUSED)
