// Package engine runs the DeepSeek-V4 attention sub-layer reference one decode
// step at a time, names every intermediate as a stage tensor, and replays GPU
// dumps against it.
package engine
