// Kernels that set a CUDA graph conditional node's value from device memory, so every
// replay of the graph reads the value as it is then (a condition handle's value is
// otherwise fixed at capture): graph_if_node.py places one before each conditional node it
// adds, in the stream's order or as a root node of the graph.

struct IfFlagParams {
  cudaGraphConditionalHandle handle;
  const unsigned char* flag;  // a 0-dim torch.bool CUDA tensor
};

extern "C" __global__ void set_if_flag(IfFlagParams p) {
  cudaGraphSetConditional(p.handle, p.flag[0] ? 1u : 0u);
}

struct SwitchIndexParams {
  cudaGraphConditionalHandle handle;
  const int* index;  // a 0-dim torch.int32 CUDA tensor: the branch to run
};

extern "C" __global__ void set_switch_index(SwitchIndexParams p) {
  cudaGraphSetConditional(p.handle, static_cast<unsigned int>(p.index[0]));
}
