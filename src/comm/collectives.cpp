// Differentiable collectives; see collectives.h. The forward and backward
// exchanges go through the Communicator, which checks the arguments.
#include "comm/collectives.h"

#include "autograd/node.h"
#include "comm/watchdog.h"

namespace moetrain::comm {

Tensor all_to_all_v(Communicator& comm, const Tensor& x, const std::vector<int64_t>& send_rows,
                    const std::vector<int64_t>& recv_rows) {
  Tensor y = comm.all_to_all_v(x, send_rows, recv_rows);
  Communicator* c = &comm;
  return record("all_to_all_v", y, {x}, [c, send_rows, recv_rows](const Tensor& grad_y) {
    WatchdogLabel label("backward");
    return Grads{c->all_to_all_v(grad_y, recv_rows, send_rows)};
  });
}

Tensor all_gather(Communicator& comm, const Tensor& x) {
  Tensor y = comm.all_gather(x);
  Communicator* c = &comm;
  return record("all_gather", y, {x}, [c](const Tensor& grad_y) {
    WatchdogLabel label("backward");
    return Grads{c->reduce_scatter_sum(grad_y)};
  });
}

}  // namespace moetrain::comm
