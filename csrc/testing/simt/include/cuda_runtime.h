// Stands in for the CUDA runtime header in the emulated build (this folder is on its include path
// only): the kernels' `#include <cuda_runtime.h>` gets the SIMT emulator instead.
#pragma once

#include "../simt.h"
