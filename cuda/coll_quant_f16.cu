// Quantized AllReduce kernels for f16 (bodies in flashcomm/coll_quant.cuh).
#include "flashcomm/coll_quant.cuh"

FC_QUANT_ALL(__half, f16)
