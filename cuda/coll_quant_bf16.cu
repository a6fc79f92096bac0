// Quantized AllReduce kernels for bf16 (bodies in flashcomm/coll_quant.cuh).
#include "flashcomm/coll_quant.cuh"

FC_QUANT_INSTANCES_bf16
