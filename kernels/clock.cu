// The profile clock's hold (backend/cuda, profile_clock.go): a kernel that
// computes nothing and returns ns nanoseconds of the global timer after it
// started. A benchmark queues it before its start mark, so that the work
// the host queues in the meantime (several ranks' launches after their
// barriers, say) runs back to back after it, and the timed interval holds
// the device's work, not the host's queueing. Grid: one block of 32
// threads.
extern "C" __global__ void clock_hold(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("nanosleep.u32 1000;");
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
