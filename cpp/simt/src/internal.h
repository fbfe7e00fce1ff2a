// Library-internal interface between the scheduler and the runtime API (not installed).
#pragma once
#include <fastinfer/simt/device.h>

#include <string>

#pragma GCC visibility push(hidden)
namespace fastinfer::simt::internal {
// Error of the most recent failed launch, reported once by cudaDeviceSynchronize and friends.
void record_async_error(cudaError_t e);
// Detailed message if `e` is the error of this thread's most recent fault, else nullptr.
const char* fault_message_for(cudaError_t e);
// The demangled symbol name of a kernel (kernel@ADDRESS when it has no symbol).
std::string kernel_name(const void* kernel);
}  // namespace fastinfer::simt::internal
#pragma GCC visibility pop
