// One cudaLaunchKernelEx with the launch attributes our launchers use: thread-block clusters and
// programmatic dependent launch (the kernel side of PDL is eagle3/pdl.cuh).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <utility>

namespace eagle3 {

// cluster > 0: clusters of `cluster` blocks along x; pdl: the launch may overlap the previous kernel in the
// stream (the kernel waits in wait_previous_grid before touching memory). On the current stream given.
template <typename Kernel, typename... Args>
void launch_ex(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int cluster, bool pdl,
               Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster > 0) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = static_cast<unsigned>(cluster);
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  config.attrs = attr;
  config.numAttrs = n;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace eagle3
