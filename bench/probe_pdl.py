"""Programmatic dependent launch probe (development tool, NOTES-gpu.md session 4): kernel A spins ~20 us then writes;
kernel B, launched right after it on the same stream, records %globaltimer at its start and after T.pdl_sync().
With programmatic dependent launch B starts before A ends. Usage: python3 bench/probe_pdl.py [tvm_ffi|cython]
(the cython backend links libcuda, so it builds only where a driver is installed)."""
import sys
import tilelang
import tilelang.language as T
import torch

BACKEND = sys.argv[1] if len(sys.argv) > 1 else "cython"
PRE = r"""
__device__ __forceinline__ long long fd_gt() {
  long long g;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g) :: "memory");
  return g;
}
__device__ __forceinline__ void fd_spin(long long ns) { long long t0 = fd_gt(); while (fd_gt() - t0 < ns) {} }
"""


@tilelang.jit(target={"kind": "cuda", "arch": "sm_90a"}, execution_backend=BACKEND,
              pass_configs={"tl.disable_data_race_check": True})
def build(n: int, primary: bool):
    """primary: kernel A (trigger, then spin); else kernel B (wait). Both stamp %globaltimer before and after."""
    @T.prim_func
    def kernel(out: T.Tensor((n, 2), "int64")):
        with T.Kernel(n, threads=32, prelude=PRE) as bx:
            tx = T.get_thread_binding()
            if tx == 0:
                out[bx, 0] = T.call_extern("int64", "fd_gt")
            if primary:
                T.pdl_trigger()
                T.call_extern("handle", "fd_spin", 20000)
            else:
                T.pdl_sync()
            if tx == 0:
                out[bx, 1] = T.call_extern("int64", "fd_gt")
    return kernel


if __name__ == "__main__":
    n = 8
    ka, kb = build(n, True), build(n, False)
    print("A triggers:", "cudaTriggerProgrammaticLaunchCompletion" in ka.get_kernel_source(),
          "| B waits:", "cudaGridDependencySynchronize" in kb.get_kernel_source())
    if not torch.cuda.is_available():
        sys.exit(0)
    a = torch.zeros(n, 2, dtype=torch.int64, device="cuda")
    b = torch.zeros(n, 2, dtype=torch.int64, device="cuda")
    for _ in range(3):
        ka(a)
        kb(b)
    torch.cuda.synchronize()
    a_end, b_start, b_sync = a[:, 1].max().item(), b[:, 0].min().item(), b[:, 1].min().item()
    print(f"{BACKEND}: B started {(a_end - b_start) / 1e3:.1f} us before A ended; B passed pdl_sync "
          f"{(b_sync - a_end) / 1e3:.1f} us after A ended")
