// The storage dtypes every row kernel takes, one code shared by the kernels (which switch on
// it, or pass it as an int to row_common.cuh's load_param) and the torch bindings.
#pragma once

namespace kernelforge {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

}  // namespace kernelforge
