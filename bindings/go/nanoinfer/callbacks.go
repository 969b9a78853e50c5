package nanoinfer

// This file holds the Go functions the library calls back. A file with
// //export may only declare things in its preamble.

/*
#include <stdbool.h>
#include <nanoinfer.h>
*/
import "C"

import (
	"runtime/cgo"
	"unsafe"
)

// progressState is what a model load's progress callback handle refers to.
type progressState struct {
	fn       func(progress float32) bool
	panicked any // a panic of fn, re-raised by LoadModel after the C call
	didPanic bool
}

//export nanoinferGoProgress
func nanoinferGoProgress(progress C.float, userData unsafe.Pointer) (keepGoing C.bool) {
	st := cgo.Handle(uintptr(userData)).Value().(*progressState)
	defer func() {
		// A panic must not unwind through C frames: stop the load and re-raise later.
		if r := recover(); r != nil {
			st.panicked, st.didPanic = r, true
			keepGoing = false
		}
	}()
	return C.bool(st.fn(float32(progress)))
}

//export nanoinferGoLog
func nanoinferGoLog(level C.ni_log_level, message *C.char, userData unsafe.Pointer) {
	defer func() { _ = recover() }() // a logger's panic is dropped, never crosses C frames
	fn := cgo.Handle(uintptr(userData)).Value().(func(LogLevel, string))
	fn(LogLevel(level), C.GoString(message))
}
