// Codec kernels for bf16 values (all widths 2..8); see flashcomm/codec_kernels.cuh. One file per
// element type so that the three modules compile in parallel.
#include "flashcomm/codec_kernels.cuh"

FC_CODEC_ALL_WIDTHS(__nv_bfloat16, bf16)
