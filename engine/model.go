package engine

// Model is what the decode steps of a model's layers need besides their
// inputs: the config, the attention weights of each layer it holds and each
// layer's RoPE table. Model.PrepareFast switches every layer to the prepared
// kernels; Model.Kernels names the path its layers run.
type Model struct {
	Cfg     *Config
	Weights map[int]*LayerWeights
	Rope    map[int]*RopeTable
	// Head holds the embedding and the head (LoadHeadWeights); nil when the
	// weights have none: h_in of layer 0 and the logits are then not computed.
	Head *HeadWeights
	// GPURope says the tables are the GPU's own (read from a dump), not
	// computed by LayerRope; package replay then holds RoPE stages to their
	// exact tolerance instead of one bf16 ulp.
	GPURope bool
}
