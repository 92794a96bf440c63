// Host-side test of the seven plugin adapters against the TensorRT headers alone (make host-test):
// the stand-ins of host_test.h and the checks every case goes through (testFields, testPlugin).
// host_test_main.cpp holds the cases, the registration test and main().
#include "host_test.h"
#include "plugin_common.h"

#include <algorithm>
#include <cstdio>

// ---------------------------------------------------------------- stand-ins
namespace host_test
{
int gFailures = 0;
int gChecks = 0;
std::string gCase;

LaunchLog& launches()
{
    static LaunchLog log;
    return log;
}
CaptureLogger& logger()
{
    static CaptureLogger l;
    return l;
}
FakeRegistry& registry()
{
    static FakeRegistry r;
    return r;
}
} // namespace host_test

using namespace host_test;

extern "C" nvinfer1::IPluginRegistry* getPluginRegistry() noexcept { return &registry(); }
extern "C" nvinfer1::ILogger* getLogger() noexcept { return &logger(); }

extern "C" {
// clang-format off
#define DSA_STUB(fn, Params, member)                                                                                   \
    int fn(Params const* p, cudaStream_t) { launches().member = *p; ++launches().calls;                                \
        int s = launches().nextStatus; launches().nextStatus = DSA_OK; return s; }
DSA_STUB(dsa_launch_mla_cache_write, DsaMlaCacheWriteParams, mla)
DSA_STUB(dsa_launch_indexer_k_cache_write, DsaIndexerKCacheWriteParams, indexerK)
DSA_STUB(dsa_launch_indexer_logits, DsaIndexerLogitsParams, logits)
DSA_STUB(dsa_launch_topk_translate, DsaTopkTranslateParams, topk)
DSA_STUB(dsa_launch_sparse_mla, DsaSparseMlaParams, sparse)
DSA_STUB(dsa_launch_fp8_block_linear, DsaFp8BlockLinearParams, linear)
DSA_STUB(dsa_launch_moe_experts, DsaMoeExpertsParams, moe)
// clang-format on
size_t dsa_fp8_block_linear_workspace_size(int64_t num_tokens, int n, int k)
{
    int64_t* w = launches().wsLinear;
    w[0] = num_tokens, w[1] = n, w[2] = k;
    return static_cast<size_t>(3000 + num_tokens * n);
}
size_t dsa_moe_experts_workspace_size(int64_t num_tokens, int top_k, int num_local_experts, int hidden, int inter,
    int weight_format)
{
    int64_t* w = launches().wsMoe;
    w[0] = num_tokens, w[1] = top_k, w[2] = num_local_experts, w[3] = hidden, w[4] = inter, w[5] = weight_format;
    return static_cast<size_t>(4000 + num_tokens * top_k);
}
size_t dsa_topk_translate_workspace_size(int64_t rows, int64_t max_len, int k)
{
    launches().wsRows = rows, launches().wsMaxLen = max_len, launches().wsK = k;
    return static_cast<size_t>(1000 + rows * max_len);
}
size_t dsa_sparse_mla_workspace_size(int64_t num_tokens, int num_heads, int topk, int format)
{
    launches().wsTokens = num_tokens, launches().wsHeads = num_heads, launches().wsTopk = topk;
    launches().wsFormat = format;
    return static_cast<size_t>(2000 + num_tokens * num_heads);
}
const char* dsa_last_error_message(void) { return "stub launcher failure"; }
}

// ---------------------------------------------------------------- checking
namespace host_test
{
using DT = nv::DataType;

nv::Dims dims(std::initializer_list<int64_t> d)
{
    nv::Dims r{};
    r.nbDims = static_cast<int32_t>(d.size());
    int32_t i = 0;
    for (int64_t v : d)
        r.d[i++] = v;
    return r;
}

bool sameDims(nv::Dims const& a, nv::Dims const& b)
{
    return a.nbDims == b.nbDims && std::equal(a.d, a.d + a.nbDims, b.d);
}

namespace
{
// Field collections as ONNX (int64 / float32), TensorRT serialisation (int32 / float32) or wide
// (int64 / float64) deliver them.
class Fields
{
public:
    void add(char const* name, nv::PluginFieldType type, double v, int32_t length = 1)
    {
        auto& slot = mData.emplace_back();
        std::memset(slot.data(), 0, slot.size());
        switch (type)
        {
        case nv::PluginFieldType::kINT32: store<int32_t>(slot, static_cast<int32_t>(v)); break;
        case nv::PluginFieldType::kINT64: store<int64_t>(slot, static_cast<int64_t>(v)); break;
        case nv::PluginFieldType::kFLOAT32: store<float>(slot, static_cast<float>(v)); break;
        case nv::PluginFieldType::kFLOAT64: store<double>(slot, v); break;
        default: std::memcpy(slot.data(), "1", 2); break;
        }
        mFields.emplace_back(name, slot.data(), type, length);
    }
    nv::PluginFieldCollection const* get()
    {
        mFc.nbFields = static_cast<int32_t>(mFields.size());
        mFc.fields = mFields.data();
        return &mFc;
    }

private:
    template <class T>
    static void store(std::array<char, 16>& slot, T v)
    {
        std::memcpy(slot.data(), &v, sizeof(T)); // two copies: a length-2 field still reads in bounds
        std::memcpy(slot.data() + 8, &v, sizeof(T));
    }
    std::deque<std::array<char, 16>> mData;
    std::vector<nv::PluginField> mFields;
    nv::PluginFieldCollection mFc{};
};
} // namespace

nv::IPluginV3* create(Case const& c, bool wide, FieldArg const* skip, double override)
{
    Fields f;
    for (FieldArg const& a : c.fields)
    {
        if (skip != nullptr && std::strcmp(skip->name, a.name) == 0 && override == 0.0)
            continue;
        double const v = skip != nullptr && std::strcmp(skip->name, a.name) == 0 ? override : a.value;
        f.add(a.name,
            a.isInt ? (wide ? nv::PluginFieldType::kINT64 : nv::PluginFieldType::kINT32)
                    : (wide ? nv::PluginFieldType::kFLOAT64 : nv::PluginFieldType::kFLOAT32),
            v);
    }
    return c.creator->createPlugin("test", f.get(), nv::TensorRTPhase::kBUILD);
}

void testFields(Case const& c)
{
    nv::PluginFieldCollection const* names = c.creator->getFieldNames();
    EXPECT(names->nbFields == static_cast<int32_t>(c.fields.size()));
    for (int32_t i = 0; i < names->nbFields && i < static_cast<int32_t>(c.fields.size()); ++i)
        EXPECT(std::strcmp(names->fields[i].name, c.fields[i].name) == 0);
    for (bool wide : {false, true})
    {
        nv::IPluginV3* p = create(c, wide);
        EXPECT(p != nullptr);
        delete p;
    }
    for (FieldArg const& a : c.fields)
    {
        EXPECT(create(c, true, &a) == nullptr); // missing
        EXPECT_LOGGED(std::string("missing field '") + a.name + "'");
        if (!a.isInt)
        {
            EXPECT(create(c, true, &a, -1.0) == nullptr);
            EXPECT_LOGGED("must be finite and > 0");
        }
    }
    auto allBut = [&](char const* left) {
        Fields f;
        for (FieldArg const& a : c.fields)
            if (left == nullptr || std::strcmp(a.name, left) != 0)
                f.add(a.name, a.isInt ? nv::PluginFieldType::kINT64 : nv::PluginFieldType::kFLOAT32, a.value);
        return f;
    };
    Fields unknown = allBut(nullptr);
    unknown.add("bogus", nv::PluginFieldType::kINT64, 1);
    EXPECT(c.creator->createPlugin("test", unknown.get(), nv::TensorRTPhase::kBUILD) == nullptr);
    EXPECT_LOGGED("unknown field 'bogus'");
    FieldArg const& first = c.fields[0];
    Fields twoValues = allBut(first.name);
    twoValues.add(
        first.name, first.isInt ? nv::PluginFieldType::kINT64 : nv::PluginFieldType::kFLOAT32, first.value, 2);
    EXPECT(c.creator->createPlugin("test", twoValues.get(), nv::TensorRTPhase::kBUILD) == nullptr);
    EXPECT_LOGGED("must be one scalar, got length 2");
    Fields ignored; // what the ONNX importer may pass through besides the attributes
    for (FieldArg const& a : c.fields)
        ignored.add(a.name, a.isInt ? nv::PluginFieldType::kINT64 : nv::PluginFieldType::kFLOAT32, a.value);
    ignored.add("plugin_version", nv::PluginFieldType::kCHAR, 0, 2);
    ignored.add("plugin_namespace", nv::PluginFieldType::kCHAR, 0, 2);
    nv::IPluginV3* p = c.creator->createPlugin("test", ignored.get(), nv::TensorRTPhase::kBUILD);
    EXPECT(p != nullptr);
    delete p;
    for (FieldArg const& a : c.fields)
        if (a.isInt)
        {
            Fields f;
            for (FieldArg const& b : c.fields)
                f.add(b.name, &a == &b || !b.isInt ? nv::PluginFieldType::kFLOAT32 : nv::PluginFieldType::kINT64,
                    b.value);
            EXPECT(c.creator->createPlugin("test", f.get(), nv::TensorRTPhase::kBUILD) == nullptr);
            EXPECT_LOGGED("has type kFLOAT32; expected an integer");
        }
    FieldArg const cacheFormat{"cache_format", true, 2};
    for (FieldArg const& a : c.fields)
        if (std::strcmp(a.name, "cache_format") == 0)
        {
            EXPECT(create(c, true, &cacheFormat, 2.0) == nullptr);
            EXPECT_LOGGED("cache_format=2 out of range");
        }
}

std::map<std::string, std::string> serialized(nv::IPluginV3OneRuntime* rt)
{
    std::map<std::string, std::string> out;
    nv::PluginFieldCollection const* fc = rt->getFieldsToSerialize();
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
    {
        nv::PluginField const& f = fc->fields[i];
        out[f.name] = f.type == nv::PluginFieldType::kINT32
            ? std::to_string(*static_cast<int32_t const*>(f.data))
            : f.type == nv::PluginFieldType::kFLOAT32 ? std::to_string(*static_cast<float const*>(f.data)) : "?";
    }
    return out;
}

void testPlugin(Case const& c)
{
    nv::IPluginV3* plugin = create(c, true);
    EXPECT(plugin != nullptr);
    if (plugin == nullptr)
        return;
    using Cap = nv::PluginCapabilityType;
    auto* core = static_cast<nv::IPluginV3OneCore*>(plugin->getCapabilityInterface(Cap::kCORE));
    auto* build = static_cast<nv::IPluginV3OneBuild*>(plugin->getCapabilityInterface(Cap::kBUILD));
    auto* rt = static_cast<nv::IPluginV3OneRuntime*>(plugin->getCapabilityInterface(Cap::kRUNTIME));
    EXPECT(core != nullptr && build != nullptr && rt != nullptr);
    EXPECT(std::strcmp(core->getPluginName(), c.creator->getPluginName()) == 0);
    EXPECT(std::strcmp(core->getPluginNamespace(), "dsa") == 0 && std::strcmp(core->getPluginVersion(), "1") == 0);
    EXPECT((build->getInterfaceInfo().major == 2) == (c.aliasedInput >= 0));
    if (c.aliasedInput >= 0)
    {
        auto* v2 = static_cast<nv::IPluginV3OneBuildV2*>(build);
        EXPECT(v2->getAliasedInput(0) == c.aliasedInput);
        EXPECT(v2->getAliasedInput(1) == -1);
    }
    int32_t const nbIn = static_cast<int32_t>(c.inputs.size());
    int32_t const nbOut = static_cast<int32_t>(c.outputs.size());
    EXPECT(build->getNbOutputs() == nbOut);

    std::vector<DT> inTypes, outTypes(nbOut);
    for (TensorSpec const& t : c.inputs)
        inTypes.push_back(t.types[0]);
    EXPECT(build->getOutputDataTypes(outTypes.data(), nbOut, inTypes.data(), nbIn) == 0);
    for (int32_t i = 0; i < nbOut; ++i)
        EXPECT(outTypes[i] == c.outputs[i].types[0]);

    FakeExprBuilder eb;
    std::vector<nv::DimsExprs> inExprs, outExprs(nbOut);
    for (TensorSpec const& t : c.inputs)
        inExprs.push_back(eb.exprs(t.dims));
    EXPECT(build->getOutputShapes(inExprs.data(), nbIn, nullptr, 0, outExprs.data(), nbOut, eb) == 0);
    for (int32_t i = 0; i < nbOut; ++i)
    {
        nv::Dims got{};
        got.nbDims = outExprs[i].nbDims;
        for (int32_t d = 0; d < got.nbDims; ++d)
            got.d[d] = outExprs[i].d[d] != nullptr ? outExprs[i].d[d]->getConstantValue() : -99;
        EXPECT(sameDims(got, c.outputs[i].dims));
    }

    std::vector<nv::DynamicPluginTensorDesc> io(nbIn + nbOut);
    for (int32_t i = 0; i < nbIn + nbOut; ++i)
    {
        TensorSpec const& t = i < nbIn ? c.inputs[i] : c.outputs[i - nbIn];
        io[i].desc = nv::PluginTensorDesc{t.dims, t.types[0], nv::TensorFormat::kLINEAR, -1.F};
        io[i].min = io[i].opt = io[i].max = t.dims;
    }
    for (int32_t pos = 0; pos < nbIn + nbOut; ++pos)
    {
        TensorSpec const& t = pos < nbIn ? c.inputs[pos] : c.outputs[pos - nbIn];
        for (DT alt : {DT::kFLOAT, DT::kHALF, DT::kINT8, DT::kINT32, DT::kBOOL, DT::kUINT8, DT::kFP8, DT::kBF16,
                 DT::kINT64})
        {
            io[pos].desc.type = alt;
            bool const expected = std::find(t.types.begin(), t.types.end(), alt) != t.types.end();
            gCase = c.label + " pos " + std::to_string(pos) + " " + dsa_trt::dataTypeName(alt);
            EXPECT(build->supportsFormatCombination(pos, io.data(), nbIn, nbOut) == expected);
        }
        gCase = c.label;
        io[pos].desc.type = t.types[0];
        io[pos].desc.format = nv::TensorFormat::kCHW32;
        EXPECT(!build->supportsFormatCombination(pos, io.data(), nbIn, nbOut));
        io[pos].desc.format = nv::TensorFormat::kLINEAR;
    }

    std::vector<nv::DynamicPluginTensorDesc> wild = io; // build time: the token count is dynamic
    for (nv::DynamicPluginTensorDesc& d : wild)
        d.desc.dims.d[0] = -1;
    EXPECT(build->configurePlugin(wild.data(), nbIn, wild.data() + nbIn, nbOut) == 0);
    std::vector<nv::PluginTensorDesc> in, out;
    for (int32_t i = 0; i < nbIn + nbOut; ++i)
        (i < nbIn ? in : out).push_back(io[i].desc);
    EXPECT(rt->onShapeChange(in.data(), nbIn, out.data(), nbOut) == 0);
    std::vector<nv::PluginTensorDesc> broken = in;
    c.breakShape(broken);
    EXPECT(rt->onShapeChange(broken.data(), nbIn, out.data(), nbOut) != 0);
    EXPECT_LOGGED(c.breakMessage);
    EXPECT(logger().messages.empty());

    std::map<std::string, std::string> const fields = serialized(rt);
    EXPECT(fields.size() == c.fields.size());
    nv::IPluginV3* restored = c.creator->createPlugin("test", rt->getFieldsToSerialize(), nv::TensorRTPhase::kRUNTIME);
    EXPECT(restored != nullptr);
    nv::IPluginV3* cloned = plugin->clone();
    nv::IPluginV3* attached = rt->attachToContext(nullptr);
    for (nv::IPluginV3* other : {restored, cloned, attached})
    {
        EXPECT(other != nullptr);
        if (other != nullptr)
            EXPECT(serialized(static_cast<nv::IPluginV3OneRuntime*>(
                       other->getCapabilityInterface(nv::PluginCapabilityType::kRUNTIME)))
                == fields);
        delete other;
    }

    std::vector<void const*> inPtrs(nbIn);
    std::vector<void*> outPtrs(nbOut);
    for (int32_t i = 0; i < nbIn; ++i)
        inPtrs[i] = reinterpret_cast<void const*>(uintptr_t{0x10000} * (i + 1));
    for (int32_t i = 0; i < nbOut; ++i)
        outPtrs[i] = reinterpret_cast<void*>(uintptr_t{0x100000} * (i + 1));
    if (c.aliasedInput >= 0)
        outPtrs[0] = const_cast<void*>(inPtrs[c.aliasedInput]);
    char workspace[16];
    int const calls = launches().calls;
    EXPECT(rt->enqueue(in.data(), out.data(), inPtrs.data(), outPtrs.data(), workspace, nullptr) == 0);
    EXPECT(launches().calls == calls + 1);
    c.checkLaunch(inPtrs.data(), outPtrs.data());
    launches().nextStatus = DSA_ERR_UNSUPPORTED;
    EXPECT(rt->enqueue(in.data(), out.data(), inPtrs.data(), outPtrs.data(), workspace, nullptr)
        == DSA_ERR_UNSUPPORTED);
    EXPECT_LOGGED("enqueue: stub launcher failure");
    if (c.aliasedInput >= 0)
    {
        outPtrs[0] = workspace;
        EXPECT(rt->enqueue(in.data(), out.data(), inPtrs.data(), outPtrs.data(), workspace, nullptr) != 0);
        EXPECT_LOGGED("PreviewFeature::kALIASED_PLUGIN_IO_10_03");
    }
    if (c.aliasedInput >= 0)
        outPtrs[0] = const_cast<void*>(inPtrs[c.aliasedInput]);
    std::vector<nv::PluginTensorDesc> empty = in; // a step with no tokens launches nothing
    empty[0].dims.d[0] = 0;
    int const before = launches().calls;
    EXPECT(rt->enqueue(empty.data(), out.data(), inPtrs.data(), outPtrs.data(), workspace, nullptr) == 0);
    EXPECT(launches().calls == before);
    delete plugin;
}


} // namespace host_test
