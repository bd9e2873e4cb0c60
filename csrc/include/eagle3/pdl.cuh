// Programmatic dependent launch (sm_90+; both are no-ops when the grid was launched without the
// cudaLaunchAttributeProgrammaticStreamSerialization attribute, and compiled out below sm_90).
#pragma once

namespace eagle3 {

// Before the first read of any input and the first write of any output: returns once the previous grid
// in the stream has completed and its writes are visible.
__device__ __forceinline__ void wait_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next PDL launch place its blocks in slots this grid frees, so its launch latency overlaps this
// grid's tail. Give it once every block of this grid is resident, so the next grid never takes a slot
// this one still needs (the next grid still waits for this one to complete before it reads anything).
__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace eagle3
