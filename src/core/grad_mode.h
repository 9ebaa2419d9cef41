// Grad mode: whether ops record a backward. Thread-local, on by default.
// In core/ (as PyTorch keeps GradMode in c10/core) because core's own in-place
// writes (fill_, copy_) refuse a tensor that requires grad while it is on; the
// functions keep autograd's namespace, whose switch they are.
#pragma once

namespace moetrain::autograd {

bool grad_enabled();
void set_grad_enabled(bool on);

}  // namespace moetrain::autograd

namespace moetrain {

// Disables recording in a scope (evaluation, optimizer updates, recomputation
// bookkeeping); restores the previous mode on exit.
class NoGradGuard {
 public:
  NoGradGuard() : prev_(autograd::grad_enabled()) { autograd::set_grad_enabled(false); }
  ~NoGradGuard() { autograd::set_grad_enabled(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

// Re-enables recording inside a NoGradGuard scope (used by checkpoint recomputation).
class EnableGradGuard {
 public:
  EnableGradGuard() : prev_(autograd::grad_enabled()) { autograd::set_grad_enabled(true); }
  ~EnableGradGuard() { autograd::set_grad_enabled(prev_); }
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool prev_;
};

}  // namespace moetrain
