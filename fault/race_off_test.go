//go:build !race

package fault

// raceDetector is true when the tests run under the race detector (-race).
const raceDetector = false
