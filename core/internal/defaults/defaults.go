package defaults

// Number is a size, count or duration setting.
type Number interface {
	~int | ~int32 | ~int64 | ~uint32 | ~uint64 | ~float64
}

// Positive sets *v to def unless *v is above zero.
func Positive[T Number](v *T, def T) {
	if *v <= 0 {
		*v = def
	}
}
