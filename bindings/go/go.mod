module github.com/nanoinfer/nanoinfer/bindings/go

// 1.24: iter.Seq2 (1.23) and runtime.AddCleanup (1.24).
go 1.24
