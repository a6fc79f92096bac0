// Quantized AllGather, AllToAll and ReduceScatter kernels for f16 (bodies in flashcomm/coll_quant_ops.cuh).
#include "flashcomm/coll_quant_ops.cuh"

FC_QUANT_OPS_INSTANCES_f16
