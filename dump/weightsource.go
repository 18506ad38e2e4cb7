package dump

// WeightSource is a store of named tensors read lazily by official name: a
// safetensors file (*Safetensors) or a checkpoint directory (*Checkpoint:
// index.json + shards, HF or official names).
type WeightSource interface {
	// Lookup returns the header entry of a tensor without reading it.
	Lookup(name string) (SafetensorsEntry, bool)
	// Read reads a tensor.
	Read(name string) (Record, error)
	// Name names the source in errors (file or directory).
	Name() string
}

// Lookup is Entry (WeightSource).
func (s *Safetensors) Lookup(name string) (SafetensorsEntry, bool) { return s.Entry(name) }

// Name is the file's path (WeightSource).
func (s *Safetensors) Name() string { return s.Path }

// Lookup finds a tensor by official or HF name (WeightSource); a shard that
// cannot be opened reads as absent here and fails in Read.
func (c *Checkpoint) Lookup(name string) (SafetensorsEntry, bool) {
	e, err := c.Entry(name)
	return e, err == nil
}

// Name is the checkpoint directory (WeightSource).
func (c *Checkpoint) Name() string { return c.Dir }

var (
	_ WeightSource = (*Safetensors)(nil)
	_ WeightSource = (*Checkpoint)(nil)
)
