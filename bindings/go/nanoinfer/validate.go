package nanoinfer

import (
	"fmt"
	"math"
)

// The C parameters are unsigned or 32-bit; Go's int is neither. A negative
// or oversized value is refused here with the field's name instead of
// wrapping (a MaxTokens of -1 would otherwise become 4 294 967 295).

func invalidArgument(op, format string, args ...any) error {
	return &Error{Status: StatusInvalidArgument, Op: op, Message: fmt.Sprintf(format, args...)}
}

// fieldCheck collects the first bad field of one options struct.
type fieldCheck struct {
	op  string
	err error
}

func (c *fieldCheck) uint32(name string, v int) uint32 {
	if c.err == nil && (v < 0 || uint64(v) > math.MaxUint32) {
		c.err = invalidArgument(c.op, "%s must be in [0, %d], got %d", name, uint64(math.MaxUint32), v)
	}
	return uint32(max(v, 0))
}

func (c *fieldCheck) uint64(name string, v int64) uint64 {
	if c.err == nil && v < 0 {
		c.err = invalidArgument(c.op, "%s must be >= 0, got %d", name, v)
	}
	return uint64(max(v, 0))
}

func (c *fieldCheck) int32(name string, v int) int32 {
	if c.err == nil && (v < math.MinInt32 || v > math.MaxInt32) {
		c.err = invalidArgument(c.op, "%s must fit in 32 bits, got %d", name, v)
	}
	return int32(v)
}
