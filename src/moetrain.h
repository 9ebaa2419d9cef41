// Everything a model or a test needs from the core: tensors, autograd, ops.
#pragma once

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "autograd/node.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "ops/attention.h"
#include "ops/conv.h"
#include "ops/dropout.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/linalg.h"
#include "ops/norm.h"
#include "ops/reduce.h"
#include "ops/softmax.h"
#include "ops/topk.h"
#include "ops/view.h"
