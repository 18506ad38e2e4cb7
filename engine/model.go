package engine

// Model is what the reference needs besides the dump: the config, the
// attention weights of each replayed layer and each layer's RoPE table.
type Model struct {
	Cfg     *Config
	Weights map[int]*LayerWeights
	Rope    map[int]*RopeTable
	// GPURope says the tables are the GPU's own (dumped); RoPE stages are then
	// held to their exact tolerance instead of one bf16 ulp.
	GPURope bool
}
