// Differentiable collectives: autograd ops over a Communicator, for collectives
// inside the model (expert-parallel dispatch and combine).
//
// The backward of a collective is itself a collective, so every rank of the
// group must run backward through every recorded collective, in the same order:
// the output must reach each rank's loss, and the input must require grad on
// every rank or on none. The communicator must outlive the graph.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"

namespace moetrain::comm {

// Communicator::all_to_all_v as an op: y [sum(recv_rows), ...] from x
// [sum(send_rows), ...]. Backward: the gradient goes back the way the rows came,
// an all_to_all_v of grad_y with send and receive counts swapped.
Tensor all_to_all_v(Communicator& comm, const Tensor& x, const std::vector<int64_t>& send_rows,
                    const std::vector<int64_t>& recv_rows);

// Communicator::all_gather as an op: y [size * n, ...] from x [n, ...].
// Backward: grad_x = rows [rank * n, (rank + 1) * n) of the sum over ranks of
// grad_y, i.e. Communicator::reduce_scatter_sum(grad_y).
Tensor all_gather(Communicator& comm, const Tensor& x);

}  // namespace moetrain::comm
