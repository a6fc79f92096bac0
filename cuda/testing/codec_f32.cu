// Codec kernels for f32 values (all widths 2..8); see flashcomm/codec_kernels.cuh. One file per
// element type so that the three modules compile in parallel.
#include "flashcomm/codec_kernels.cuh"

FC_CODEC_ALL_WIDTHS(float, f32)
