// The first node of each if-node that graph_if_node.py captures: it sets the node's
// condition from a flag in device memory, so every replay of the graph reads the flag as
// it is then (a condition handle's value is otherwise fixed at capture).

struct IfFlagParams {
  cudaGraphConditionalHandle handle;
  const unsigned char* flag;  // a 0-dim torch.bool CUDA tensor
};

extern "C" __global__ void set_if_flag(IfFlagParams p) {
  cudaGraphSetConditional(p.handle, p.flag[0] ? 1u : 0u);
}
